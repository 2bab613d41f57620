"""The decode role of a worker's engine: reserve pages for remote prefill, admit on the KV notice, decode.

One request's transfer here (states in common/transfer/session.py): `Generate` with a peer queues it (its
reply is immediate), the scheduler reserves its pages when it next settles transfers, each loop turn
(`reserved`), and a `Reserved` event on the request's stream carries them: the control plane's leave to send
them to that peer (session "requested"). The peer's notice
ends it (`tick`): "landed" admits the
request into the running batch, "closed" fails it. A request given up on before that keeps its pages (`held`)
until a notice of its peer, or until the control plane learns from the request's exchange with the peer that
no write of it can come (`PrefillSettled`: decode_worker/remote_prefill.py). The scheduler reserves, admits
and frees through the role, its KV connector (common/sched/kv_connector.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from common.kv.pool import checksums_match
from common.protocol import TokenLine
from common.sched.kv_connector import FinishedTransfers, KVArrival, KVConnector
from common.sched.request import Req
from common.transfer.receiver import Arrival, KVReceiver
from common.worker.commands import Handlers, Refused
from common.worker.engine_host import EngineHost
from common.worker.messages import (
    Generate,
    KVForcedRelease,
    PrefillFailed,
    PrefillSettled,
    Reserved,
    Tokens,
)

log = logging.getLogger("kvferry.decode")


@dataclass
class PendingRemote:
    """A request waiting for pages (reservation) or for its KV to arrive (transfer)."""

    req: Req
    deadline: float
    peer: str
    peer_instance: str
    reserved: bool = False


class DecodeRole(KVConnector):
    """The engine's own requests: prefilled here or by a peer into pages reserved here, then decoded. It is the
    scheduler's KV connector for them: which requests wait for pages (`reservations`, `reserved`), whose KV
    arrived, and which given-up requests' pages a peer may still write (`aborted`: held) or no longer can
    (`finished`)."""

    transfers = True

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.receiver = KVReceiver(self.host.agent)
        self.remote: dict[str, PendingRemote] = {}
        # Given-up requests whose pages a prefill peer may still write: freed when their session ends.
        self.held: set[str] = set()
        self.done = FinishedTransfers()  # what `finished` hands the scheduler next
        self.handlers: Handlers = {
            Generate: self._generate,
            PrefillFailed: self._prefill_failed,
            PrefillSettled: self._prefill_settled,
        }

    def has_work(self) -> bool:
        return bool(self.remote) or bool(self.held)

    def holds(self, req_id: str) -> bool:
        return True  # every request no other role holds is this role's (or none's: its abort is a no-op)

    def waits_only(self) -> bool:
        return False  # a notice is read the turn it arrives

    def hands_on_stamps(self, req_id: str) -> bool:
        return False

    def _generate(self, cmd: Generate) -> None:
        req = self.host.make_req(cmd.req_id, cmd.token_ids, cmd.sampling, cmd.received)
        if cmd.peer is None or cmd.peer_instance is None:
            self.host.enqueue(req)
            return None
        self.host.scheduler.validate(req)
        self.host.scheduler.prefetch_grammar(req)  # compiled off the loop while the peer prefills
        if self.host.scheduler.has_request(req.req_id) or req.req_id in self.remote or req.req_id in self.held:
            raise Refused(f"duplicate request id {req.req_id!r}", "duplicate_request")
        # Its pages are reserved when the scheduler settles transfers, in this loop turn when they are free; the
        # reply does not wait for them (a caller that leaves meanwhile is heard at once), the stream does.
        deadline = time.monotonic() + cmd.timeout_s
        self.remote[req.req_id] = PendingRemote(req, deadline, cmd.peer, cmd.peer_instance)

    def reservations(self) -> list[Req]:
        return [p.req for p in self.remote.values() if not p.reserved]

    def reserved(self, req: Req, pages: list[int]) -> None:
        rid = req.req_id
        pending = self.remote[rid]
        pending.reserved = True
        self.host.mark(rid, "pages_reserved")
        self.receiver.reserve(rid, pending.peer, pending.peer_instance)  # the ids leave with the reply
        self.host.outbox.append(Reserved(rid, pages))

    # ---- giving up -----------------------------------------------------------------------------------
    def abort(self, req_id: str, reason: str, error: str | None) -> None:
        pending = self.remote.pop(req_id, None)
        if pending is not None and not pending.reserved:  # no pages yet: nothing to hold
            line = TokenLine(finish_reason=reason if error is None else "error", error=error)  # type: ignore[arg-type]
            self.host.emit(Tokens(req_id, line))
            return
        self.receiver.give_up(req_id, error or reason)  # first: `aborted` asks the session
        event = self.host.scheduler.abort(req_id, reason="abort" if error is None else "error", error=error)
        if event is not None:
            self.host.emit_step_events([event])

    def aborted(self, req: Req) -> bool:
        """An aborted request's pages stay held while a write may still land (until the session's end)."""
        if self.receiver.holds(req.req_id):
            self.held.add(req.req_id)
            return True
        return False

    def _release_held(self, req_id: str) -> None:
        if req_id in self.held:
            self.held.discard(req_id)
            self.done.released.append(req_id)  # the scheduler frees them when it next asks

    def _prefill_failed(self, cmd: PrefillFailed) -> None:
        if cmd.req_id in self.remote:  # else the KV arrived already, or the request ended
            self.abort(cmd.req_id, "error", cmd.error)

    def _prefill_settled(self, cmd: PrefillSettled) -> None:
        """No write of the request can come any more: its session ends, and so does the request if it waited."""
        if not self.receiver.settle(cmd.req_id, cmd.error):
            return  # its KV landed, or it ended already
        if cmd.req_id in self.held:
            self._release_held(cmd.req_id)
        elif cmd.req_id in self.remote:
            self.abort(cmd.req_id, "error", cmd.error)

    def finished(self) -> FinishedTransfers | None:
        done, self.done = self.done, FinishedTransfers()
        return done

    # ---- the loop turn ---------------------------------------------------------------------------------
    def tick(self) -> None:
        for arrival in self.receiver.poll():
            try:
                self._on_arrival(arrival)
            except Exception as e:  # one request's notice must not take the engine down
                log.exception("KV notice handling failed", extra={"req_id": arrival.req_id})
                self.abort(arrival.req_id, "error", f"KV notice handling failed: {type(e).__name__}: {e}")
        forced = self.receiver.overdue()
        for rid in forced:
            self._release_held(rid)
        if forced:
            self.host.outbox.append(KVForcedRelease(len(forced)))
        if self.remote:
            now = time.monotonic()
            for rid in [r for r, p in self.remote.items() if now > p.deadline]:
                stage = "KV transfer" if self.remote[rid].reserved else "KV page reservation"
                self.abort(rid, "error", f"{stage} did not finish within its deadline")

    def _on_arrival(self, a: Arrival) -> None:
        if a.kind == "released":
            self._release_held(a.req_id)
        elif a.kind == "malformed":
            self.abort(a.req_id, "error", a.error)  # the session holds the pages until the peer confirms or dies
        elif a.kind == "closed":
            self.abort(a.req_id, "error", f"prefill failed: {a.error}")
        else:
            self._admit(a)

    def _admit(self, a: Arrival) -> None:
        """The KV landed (the session is over: no write follows), so a failure here frees the pages at once."""
        notice = a.notice
        assert notice is not None and notice.token is not None
        pending = self.remote.get(a.req_id)
        if pending is None:
            return
        stamps = self.host.stamps.get(a.req_id)
        if stamps is not None:
            stamps["kv_landed"] = time.time()
            if notice.timeline:  # the prefill worker's stages
                stamps.update(notice.timeline)
        verified = None
        if notice.checksums is not None:
            mine = self.host.runner.kv_checksums(torch.tensor(pending.req.pages, dtype=torch.int64))
            verified = None if mine is None else checksums_match(mine, notice.checksums)
            if verified is False:
                self.abort(a.req_id, "error", "KV pages arrived corrupted (checksum mismatch)")
                return
        if notice.token >= self.host.runner.model_config.vocab_size:
            self.abort(a.req_id, "error", f"KV notice from {a.peer}: token {notice.token} outside the vocabulary")
            return
        del self.remote[a.req_id]
        # Joins the running batch when the scheduler settles transfers, right after this tick.
        self.done.arrived.append(
            KVArrival(a.req_id, notice.token, notice.logprob, notice.cached_tokens, notice.prompt_logprobs)
        )
        if verified:
            self.host.kv_verified[a.req_id] = True
