"""The prefill worker's engine loop: chunked prefill over the radix cache, each chunk pushed over NIXL."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch

from common.protocol import HandshakeRequest, PrefillRequest
from common.sched.request import Req
from common.serving.channel import Message
from common.serving.engine_host import EngineHost
from common.transfer.agent import PeerError
from common.transfer.layout import LayoutMismatch
from common.transfer.sender import KVSender, RequestTransfer, TransferError

log = logging.getLogger("kvferry.prefill")


@dataclass
class Outbound:
    """One request's KV on its way to a decode worker."""

    req: Req
    transfer: RequestTransfer
    dst_pages: torch.Tensor
    sent_pages: int = 0
    failed: str | None = None
    computed: bool = False  # prefill done, pages parked until the transfer completes


class PrefillHost(EngineHost):
    role = "prefill"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if self.runner.per_rank_agents:
            self.runner.close()
            raise RuntimeError(
                "a prefill worker with KVFERRY_TP_SIZE > 1 sends every rank's KV from rank 0, which needs the "
                "ranks' pools in shared memory (CPU ranks); GPU ranks cannot send yet: run prefill at TP=1 on "
                "GPUs (a TP=N decode worker receives from it)"
            )
        self.sender = KVSender(self.agent)
        self.outbound: dict[str, Outbound] = {}
        self.scheduler.on_prefill_chunk = self._on_chunk
        self.scheduler.on_prefill_done = self._on_prefill_done
        self.stats = {"descs": 0, "bytes": 0, "transfers": 0}

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.outbound)

    def handle_role(self, msg: Message) -> None:
        op = msg["op"]
        if op == "add_peer":
            hs = HandshakeRequest.model_validate(msg["handshake"])
            try:
                self.agent.add_peer(hs.agent_name, hs.instance_id, hs.agent_metadata_b64, hs.pool_info_b64, hs.layout)
            except LayoutMismatch as e:
                self.reject(msg, str(e), "layout_mismatch")
                return
            except PeerError as e:  # undecodable or inconsistent handshake: the caller's fault (400)
                self.reject(msg, str(e), "invalid_request")
                return
            self.reply(
                msg,
                agent_name=self.agent.name,
                instance_id=self.agent.instance_id,
                layout=self.agent.layout.model_dump(),
            )
        elif op == "prefill":
            pr = PrefillRequest.model_validate(msg["prefill"])
            if not self.agent.has_peer(pr.dst_agent, pr.dst_instance_id):
                self.reject(msg, f"no handshake with {pr.dst_agent} instance {pr.dst_instance_id}", "unknown_peer")
                return
            # Checked here, not when the first chunk is posted: a bad page id raised inside a scheduler
            # step would take the engine process (and every request on it) down.
            dst_pool = self.agent.peer(pr.dst_agent).num_pages
            if any(p < 0 or p >= dst_pool for p in pr.dst_pages):
                self.reject(msg, f"dst_pages must lie in [0, {dst_pool}) (the peer's pool)", "invalid_request")
                return
            dst = torch.tensor(pr.dst_pages, dtype=torch.int64)
            if dst.numel() != -(-len(pr.token_ids) // self.page_size):
                self.reject(msg, "dst_pages does not cover the prompt", "invalid_request")
                return
            req = self.make_req(
                {
                    "req_id": pr.req_id,
                    "token_ids": pr.token_ids,
                    "sampling": {**pr.sampling.model_dump(), "max_tokens": 1},
                }
            )
            self.scheduler.add(req)
            transfer = self.sender.request(pr.dst_agent, pr.deadline_s)
            self.outbound[pr.req_id] = Outbound(req, transfer, dst)
            self.reply(msg)
        else:
            self.reject(msg, f"unknown op {op!r}", "invalid_request")

    # ---- scheduler hooks (run inside a step) -------------------------------------------------------
    def _post(self, ob: Outbound, upto_pages: int) -> None:
        if ob.failed or upto_pages <= ob.sent_pages:
            return
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the chunk's KV must be in memory before NIXL reads it
        src = torch.tensor(ob.req.pages[ob.sent_pages : upto_pages], dtype=torch.int64)
        try:
            ob.transfer.post(src, ob.dst_pages[ob.sent_pages : upto_pages])
        except TransferError as e:
            ob.failed = str(e)
        ob.sent_pages = upto_pages

    def _on_chunk(self, req: Req, start: int, end: int) -> None:
        ob = self.outbound.get(req.req_id)
        if ob is not None and end < req.prompt_len:
            self._post(ob, end // self.page_size)  # complete pages only; the rest goes with the next chunk

    def _on_prefill_done(self, req: Req) -> None:
        ob = self.outbound.get(req.req_id)
        if ob is None:
            self.scheduler.release(req)
            return
        ob.computed = True
        self._post(ob, len(ob.dst_pages))
        if ob.failed:
            return
        lp = req.output_logprobs[0].model_dump() if req.output_logprobs else None
        note = {"req_id": req.req_id, "token": req.output_ids[0], "logprob": lp, "cached_tokens": req.prefix_hit_len}
        if self.debug_checksums:
            note["checksums"] = self.runner.kv_checksums(torch.tensor(req.pages, dtype=torch.int64))
        ob.transfer.finish(json.dumps(note).encode())

    # ---- progress --------------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        for rid in list(self.outbound):
            ob = self.outbound[rid]
            if ob.failed is None and not ob.computed and ob.transfer.expired(now):
                ob.failed = "prefill did not finish within its deadline"
            if ob.failed is not None:
                self._finish(rid, error=ob.failed)
                continue
            if not ob.computed:
                continue
            state = ob.transfer.progress(now)
            if state == "done":
                self.stats["descs"] += ob.transfer.num_descs
                self.stats["bytes"] += ob.transfer.num_bytes
                self.stats["transfers"] += 1
                self._finish(rid, error=None)
            elif state == "error":
                self._finish(rid, error=ob.transfer.error or "transfer failed")

    def _finish(self, rid: str, error: str | None) -> None:
        ob = self.outbound.pop(rid)
        if ob.transfer.state == "pending":
            ob.transfer.abort(error or "aborted")
        if ob.computed:
            self.scheduler.release(ob.req)
        else:
            self.scheduler.abort(rid, reason="error", error=error)
        fields = {"done": True, "descs": ob.transfer.num_descs, "cached_tokens": ob.req.prefix_hit_len}
        if error is not None:
            fields = {"error": error}
        self.emit(rid, **fields)

    def abort(self, req_id: str, reason: str, error: str | None) -> None:
        ob = self.outbound.get(req_id)
        if ob is not None:
            ob.failed = error or "aborted by the decode worker"
            self._finish(req_id, error=ob.failed)
