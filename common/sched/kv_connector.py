"""The seam between the scheduler and KV transfer (docs/architecture.md, "The scheduler loop"): the scheduler
owns every state and page, the connector decides about pages another process reads or writes. Asked per
chunk, per request or per loop turn, never per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.protocol import PromptLogprobs, TokenLogprob
from common.sched.request import Req


@dataclass(frozen=True)
class KVArrival:
    """A request's KV landed in its reserved pages, with the first token its prefill peer sampled."""

    req_id: str
    token: int
    logprob: TokenLogprob | None
    cached_tokens: int  # prompt tokens the peer found in its prefix cache (reported as cached)
    prompt_logprobs: PromptLogprobs | None = None  # the prompt's logprobs, when the request asked for them


@dataclass
class FinishedTransfers:
    """Transfers that ended since the scheduler last asked."""

    released: list[str] = field(default_factory=list)  # held requests: no transfer touches their pages now
    arrived: list[KVArrival] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.released or self.arrived)


class KVConnector:
    """The base: every ask answered "no transfer". A subclass that transfers says so with `transfers`; otherwise
    the scheduler asks nothing, so its step costs what it would without the seam."""

    transfers: bool = False

    def chunk_done(self, req: Req, start: int, end: int) -> None:
        """The KV of prompt tokens [start, end) of `req` is in its pages."""
        return None

    def prefill_done(self, req: Req) -> bool:
        """A `prefill_only` request's first token is sampled; True: hold its pages until `finished` releases them."""
        return False

    def aborted(self, req: Req) -> bool:
        """`req` is aborted; True: a transfer may still touch its pages: hold them (uncached) until released."""
        return False

    def reservations(self) -> Sequence[Req]:
        """Requests a peer prefills, still without pages, oldest first (reserved in turn until one does not fit)."""
        return ()

    def reserved(self, req: Req, pages: list[int]) -> None:
        """`req` holds `pages` for its prompt's KV (and its output budget) and awaits its KV."""
        return None

    def finished(self) -> FinishedTransfers | None:
        """Transfers that ended since the last call (None: none)."""
        return None


class ConnectorSet(KVConnector):
    """Several connectors over one scheduler (a mixed worker's roles): pages are held when any holds them."""

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
    """The one connector for these: the base (none), the one, or a set."""
    if not connectors:
        return KVConnector()
    return connectors[0] if len(connectors) == 1 else ConnectorSet(connectors)
