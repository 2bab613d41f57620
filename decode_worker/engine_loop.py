"""The decode worker's engine loop: reserve pages for remote prefill, admit on the KV notification, decode."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch

from common.kv.pool import checksums_match
from common.protocol import TokenLogprob
from common.sched.request import Req, ReqState
from common.serving.channel import Message
from common.serving.engine_host import EngineHost

log = logging.getLogger("kvferry.decode")

QUARANTINE_S = 2.0


@dataclass
class PendingRemote:
    """A request waiting for pages (reservation) or for its KV to arrive (transfer)."""

    req: Req
    deadline: float
    reserved: bool = False


class DecodeHost(EngineHost):
    role = "decode"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        from common.transfer.receiver import KVReceiver

        self.receiver = KVReceiver(self.agent)
        self.remote: dict[str, PendingRemote] = {}
        # Pages of requests aborted while a prefill peer was writing them: a late NIXL write must land in
        # pages nobody else uses yet, so they are freed only after a grace period.
        self.quarantine: list[tuple[float, Req]] = []
        self.scheduler.on_kv_abandoned = lambda req: self.quarantine.append((time.monotonic() + QUARANTINE_S, req))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.remote) or bool(self.quarantine)

    def handle_role(self, msg: Message) -> None:
        op = msg["op"]
        if op != "generate":
            self.reject(msg, f"unknown op {op!r}", "invalid_request")
            return
        req = self.make_req(msg)
        if msg.get("remote"):
            self.scheduler.validate(req)
            if req.req_id in self.scheduler.by_id or req.req_id in self.remote:
                self.reject(msg, f"duplicate request id {req.req_id!r}", "invalid_request")
                return
            self.remote[req.req_id] = PendingRemote(req, time.monotonic() + float(msg.get("timeout_s", 60.0)))
            self.reply(msg)
            self._try_reserve()
        else:
            self.scheduler.add(req)
            self.reply(msg)

    def _try_reserve(self) -> None:
        for rid, pending in self.remote.items():
            if pending.reserved:
                continue
            pages = self.scheduler.reserve_for_remote_prefill(pending.req)
            if pages is None:
                break  # first come, first served: later requests wait behind this one
            pending.reserved = True
            self.outbox.append({"ev": "reserved", "req_id": rid, "pages": pages.tolist()})

    def abort(self, req_id: str, reason: str, error: str | None) -> None:
        pending = self.remote.pop(req_id, None)
        if pending is not None and not pending.reserved:
            self.emit(req_id, token_ids=[], finish_reason=reason if error is None else "error", error=error)
            return
        event = self.scheduler.abort(req_id, reason="abort" if error is None else "error", error=error)
        if event is not None:
            self.emit_step_events([event])

    def handle_prefill_failed(self, req_id: str, error: str) -> None:
        pending = self.remote.get(req_id)
        if pending is not None:  # only before the KV arrived; afterwards the request no longer needs its peer
            self.abort(req_id, "error", error)

    def tick(self) -> None:
        for peer, raw in self.receiver.poll_notifications():
            try:
                note = json.loads(raw)
                rid = note["req_id"]
            except (ValueError, KeyError, TypeError):
                log.warning("malformed KV notification", extra={"peer": peer})
                continue
            pending = self.remote.get(rid)
            if pending is None or not pending.reserved or pending.req.state is not ReqState.AWAITING_KV:
                continue  # aborted meanwhile, or not for us
            del self.remote[rid]
            if "error" in note:
                self.abort(rid, "error", f"prefill failed: {note['error']}")
                continue
            verified = None
            if "checksums" in note:
                mine = self.runner.kv_checksums(torch.tensor(pending.req.pages, dtype=torch.int64))
                verified = None if mine is None else checksums_match(mine, note["checksums"])
                if verified is False:
                    self.abort(rid, "error", "KV pages arrived corrupted (checksum mismatch)")
                    continue
            lp = TokenLogprob.model_validate(note["logprob"]) if note.get("logprob") else None
            event = self.scheduler.admit_prefilled(rid, int(note["token"]), lp, int(note.get("cached_tokens", 0)))
            self.emit_step_events([event])
            if verified:
                self.outbox[-1]["kv_verified"] = True
        if self.quarantine and self.quarantine[0][0] <= time.monotonic():
            now = time.monotonic()
            due = [req for at, req in self.quarantine if at <= now]
            self.quarantine = [(at, req) for at, req in self.quarantine if at > now]
            for req in due:
                self.scheduler.free_abandoned(req)
        if self.remote:
            now = time.monotonic()
            for rid in [r for r, p in self.remote.items() if now > p.deadline]:
                stage = "KV transfer" if self.remote[rid].reserved else "KV page reservation"
                self.abort(rid, "error", f"{stage} did not finish within its deadline")
            self._try_reserve()

    def handle(self, msg: Message) -> None:
        if msg.get("op") == "prefill_failed":
            self.handle_prefill_failed(msg["req_id"], msg.get("error", "prefill failed"))
            return
        super().handle(msg)
