"""The seam between the scheduler and KV transfer: what the scheduler asks about pages another process reads
(a prefill worker sending a prompt's KV on) or writes (a decode worker's pages a peer prefills into).

The scheduler owns every request's state and every page; the connector decides, asked (each method says
what about) when a chunk's KV is in its pages, when a `prefill_only` request or an aborted one may hold its
pages, which requests wait for pages a peer fills, and which transfers ended.

Each call is per chunk, per request or per loop turn (`Scheduler.settle_transfers`), never per token. The
offline engine runs the base `KVConnector`, which says it does not transfer: the scheduler then skips every
ask. The roles' connectors live with them (prefill_worker/engine.py, decode_worker/engine.py); a
mixed worker's engine asks both (`ConnectorSet`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.protocol import TokenLogprob
from common.sched.request import Req


@dataclass(frozen=True)
class KVArrival:
    """A request's KV landed in its reserved pages, with the first token its prefill peer sampled."""

    req_id: str
    token: int
    logprob: TokenLogprob | None
    cached_tokens: int  # prompt tokens the peer found in its prefix cache (reported as cached)


@dataclass
class FinishedTransfers:
    """Transfers that ended since the scheduler last asked."""

    released: list[str] = field(default_factory=list)  # held requests: no transfer touches their pages now
    arrived: list[KVArrival] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.released or self.arrived)


class KVConnector:
    """The seam's base: every ask answered "no transfer" (nothing held, nothing sent, nothing arrives), which is
    what an aggregated pod and the offline engine run. A connector that transfers subclasses it, overrides the
    asks it needs and says so with `transfers`: a scheduler whose connector does not transfer asks nothing at
    all, so its step costs what it would without the seam."""

    transfers: bool = False

    def chunk_done(self, req: Req, start: int, end: int) -> None:
        """The KV of prompt tokens [start, end) of `req` is in its pages."""
        return None

    def prefill_done(self, req: Req) -> bool:
        """A `prefill_only` request's first token is sampled. True: hold its pages until `finished` releases
        them; False: the scheduler caches its prefix and frees them now."""
        return False

    def aborted(self, req: Req) -> bool:
        """`req` is aborted. True: a transfer may still touch its pages: hold them until `finished` releases
        them (no prefix caching: their KV is partial); False: freed now."""
        return False

    def reservations(self) -> Sequence[Req]:
        """Requests whose KV a peer computes, still without pages, oldest first: the scheduler reserves pages
        for each in turn until one does not fit."""
        return ()

    def reserved(self, req: Req, pages: list[int]) -> None:
        """`req` holds `pages` for its prompt's KV (and its output budget) and awaits its KV."""
        return None

    def finished(self) -> FinishedTransfers | None:
        """Transfers that ended since the last call (None: none)."""
        return None


class ConnectorSet(KVConnector):
    """Several connectors over one scheduler (a mixed worker's prefill and decode roles), each answering for
    its own requests: every one is asked, pages are held when any of them holds them, and the requests to
    reserve for are told to the one that listed them."""

    def __init__(self, connectors: Sequence[KVConnector]) -> None:
        self.connectors = list(connectors)
        self.transfers = any(c.transfers for c in self.connectors)
        self._lister: dict[str, KVConnector] = {}

    def chunk_done(self, req: Req, start: int, end: int) -> None:
        for c in self.connectors:
            c.chunk_done(req, start, end)

    def prefill_done(self, req: Req) -> bool:
        return any([c.prefill_done(req) for c in self.connectors])  # a list: every one is asked

    def aborted(self, req: Req) -> bool:
        return any([c.aborted(req) for c in self.connectors])

    def reservations(self) -> Sequence[Req]:
        out: list[Req] = []
        self._lister = {}
        for c in self.connectors:
            for req in c.reservations():
                self._lister[req.req_id] = c
                out.append(req)
        return out

    def reserved(self, req: Req, pages: list[int]) -> None:
        self._lister[req.req_id].reserved(req, pages)

    def finished(self) -> FinishedTransfers | None:
        done = FinishedTransfers()
        for c in self.connectors:
            part = c.finished()
            if part:
                done.released += part.released
                done.arrived += part.arrived
        return done if done else None


def combined(connectors: Sequence[KVConnector]) -> KVConnector:
    """The one connector a scheduler gets for these: none (the base, which transfers nothing), the one, or all."""
    if not connectors:
        return KVConnector()
    return connectors[0] if len(connectors) == 1 else ConnectorSet(connectors)
