"""The prefill role of a worker's engine (prefills for decode workers): chunked prefill over the radix cache,
each chunk pushed over NIXL.

One request's transfer here: `Prefill` opens its session (`RequestTransfer`), every finished chunk's complete
pages are posted as they are computed (`chunk_done`), the rest and the "landed" notice when the first token is
known (`prefill_done`, which has the scheduler hold the pages), and `tick` ends it: the request's pages go
back to the scheduler only once the session is terminal, i.e. no posted write can still read them
(common/transfer/session.py). The scheduler asks all this of the role, its KV connector
(common/sched/kv_connector.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from common.protocol import KVNotice, PrefillRequest, encode, replace
from common.sched.kv_connector import FinishedTransfers, KVConnector
from common.sched.request import Req
from common.sched.scheduler import RequestRejected
from common.settings_registry import FAULT_WRITE_DELAY_S
from common.transfer.agent import PeerError
from common.transfer.delayed_sender import make_sender
from common.transfer.layout import LayoutMismatch
from common.transfer.request_transfer import RequestTransfer, open_request
from common.transfer.sender import TransferError
from common.transfer.session import SAFETY_DEADLINE_S, TERMINAL, S
from common.worker.channel import CALL_TIMEOUT_S
from common.worker.commands import Handlers, Refused
from common.worker.engine_host import EngineHost
from common.worker.messages import (
    AddPeer,
    Cancel,
    PeerAdded,
    Prefill,
    PrefillDone,
    PrefillError,
    TransferCounts,
    TransferFigures,
    TransferStats,
    Unanswered,
)
from common.worker.rank_writes import FollowerWrites

log = logging.getLogger("kvferry.prefill")

# How long a request its decode worker cancelled before it arrived here stays refused: as long as that worker
# could still be waiting on it (its last-resort deadline), so a late arrival can never write into pages freed.
CANCELLED_KEEP_S = SAFETY_DEADLINE_S
# How long a refusal is remembered for the control plane's `Unanswered`, which follows its `Prefill` at once when
# the engine answered too late (common/worker/channel.py: CALL_TIMEOUT_S).
REFUSED_KEEP_S = max(2 * CALL_TIMEOUT_S, 60.0)
# Refusals after which no "closed" notice may go out: no such peer, or a live registration of the request owns it.
NO_NOTICE = frozenset({"unknown_peer", "duplicate_request", "request_id_in_use"})


@dataclass
class Outbound:
    """One request's KV on its way to a decode worker."""

    req: Req
    transfer: RequestTransfer
    dst_pages: torch.Tensor
    sent_pages: int = 0
    computed: bool = False  # prefill done: the scheduler holds its pages until the connector releases them
    first_token_at: float | None = None  # time.monotonic() when the prompt's first token was sampled


class PrefillRole(KVConnector):
    """The engine's prefills for decode workers: their transfer sessions, from the first chunk to the last write.
    It is the scheduler's KV connector for them: each chunk's complete pages are posted as computed
    (`chunk_done`), a prompt done holds its pages while its session may read them (`prefill_done`), and the
    sessions that ended release them (`finished`)."""

    transfers = True

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        # Ranks with NIXL agents of their own (GPUs) post their own heads' writes (common/worker/rank_writes.py).
        runner = host.runner
        self.rank_writes = None
        if runner.per_rank_agents:
            assert runner.followers is not None
            self.rank_writes = FollowerWrites(runner.followers, runner.tp.store, runner.tp.size)  # type: ignore[arg-type]
        # A test hook (fault injection, never set in a deployment): every write lands this many seconds late.
        self.sender = make_sender(self.host.agent, self.rank_writes, FAULT_WRITE_DELAY_S.read())
        self.outbound: dict[str, Outbound] = {}
        self.cancelled: dict[str, float] = {}  # req id -> monotonic time its decode worker cancelled it unseen
        # req id -> (when, the (agent, instance) a "closed" notice may go to, or None) of recent refusals
        self.refused: dict[str, tuple[float, tuple[str, str] | None]] = {}
        self.done = FinishedTransfers()  # what `finished` hands the scheduler next
        self.stats = {"descs": 0, "bytes": 0, "transfers": 0}
        self.handlers: Handlers = {
            AddPeer: self._add_peer,
            Prefill: self._take,
            Unanswered: self._unanswered,
            Cancel: lambda cmd: self._cancel(cmd.dst_agent, cmd.req_ids),
            TransferStats: self._transfer_stats,
        }

    def has_work(self) -> bool:
        return bool(self.outbound) or self.sender.writes_in_flight > 0

    def holds(self, req_id: str) -> bool:
        return req_id in self.outbound

    def waits_only(self) -> bool:
        # A write put off for staging space blocks the writes after it; its space comes back only as the earlier
        # writes complete, so the loop waits a little between polls instead of spinning (STAGING_WAIT_S, common/worker/engine_loop.py).
        return self.sender.staging_blocked

    def hands_on_stamps(self, req_id: str) -> bool:
        return req_id in self.outbound

    def _add_peer(self, cmd: AddPeer) -> PeerAdded:
        hs = cmd.handshake
        try:
            self.host.agent.add_peer(hs.agent_name, hs.instance_id, hs.agent_metadata_b64, hs.pool_info_b64, hs.layout)
        except LayoutMismatch as e:
            raise Refused(str(e), "layout_mismatch") from None
        except PeerError as e:  # undecodable or inconsistent handshake: the caller's fault (400)
            raise Refused(str(e), "invalid_request") from None
        if self.rank_writes is not None:
            self.rank_writes.add_peer(hs)  # each follower's agent loads the peer too, before any post
        return PeerAdded(self.host.agent.name, self.host.agent.instance_id, self.host.agent.layout)

    def _transfer_stats(self, cmd: TransferStats) -> TransferCounts:
        states = [ob.transfer.state.value for ob in self.outbound.values()]
        return TransferCounts(
            writes_in_flight=self.sender.writes_in_flight,
            sessions={st: states.count(st) for st in set(states)},
            posts_deferred=self.sender.posts_deferred,
            **self.stats,
        )

    def _cancel(self, dst_agent: str, req_ids: list[str]) -> None:
        """The decode worker gave these requests up. Those in flight here are aborted (their "closed" notice
        follows once their writes settled); the rest, never registered or already over, are refused should they
        arrive later."""
        now = time.monotonic()
        for rid, at in list(self.cancelled.items()):
            if now - at <= CANCELLED_KEEP_S:
                break  # oldest first: the rest are younger
            del self.cancelled[rid]
        for rid in req_ids:
            ob = self.outbound.get(rid)
            if ob is not None and ob.transfer.peer == dst_agent:
                self.abort(rid, "abort", "cancelled by the decode worker")  # its "closed" notice settles it
            elif ob is None:
                self.cancelled[rid] = now

    def _take(self, cmd: Prefill) -> None:
        pr = cmd.request
        try:
            self._accept(pr, cmd.received)
            self.refused.pop(pr.req_id, None)  # an earlier copy's refusal is not this one's
        except (Refused, RequestRejected) as e:
            now = time.monotonic()
            for rid, (at, _) in list(self.refused.items()):
                if now - at <= REFUSED_KEEP_S:
                    break  # oldest first: the rest are younger
                del self.refused[rid]
            notify = not (isinstance(e, Refused) and e.code in NO_NOTICE)
            self.refused[pr.req_id] = (now, (pr.dst_agent, pr.dst_instance_id) if notify else None)
            raise

    def _unanswered(self, cmd: Unanswered) -> None:
        """The control plane told the decode worker the engine was too late (504): it holds the pages until a
        notice. A request taken after all is aborted ("closed" follows its writes); one refused gets "closed" now."""
        refused = self.refused.pop(cmd.req_id, None)
        if refused is None:
            self.abort(cmd.req_id, "abort", "the engine answered too late")
            return
        dest = refused[1]
        if dest is None or cmd.req_id in self.outbound:
            return  # no such peer, or a live registration of the request owns its notice
        notice = KVNotice(req_id=cmd.req_id, outcome="closed", error="refused by the prefill worker's engine")
        try:
            self.sender.send_notif(dest[0], encode(notice), expect_instance=dest[1])
        except Exception as e:  # the peer is gone (or restarted): its pages are not ours to worry about
            log.info("closed notice for %s not sent: %s", cmd.req_id, e)

    def _accept(self, pr: PrefillRequest, received: float | None) -> None:
        """Opens the request's transfer session; a refusal here means nothing was registered (no write follows)."""
        if pr.req_id in self.cancelled:
            raise Refused(f"request {pr.req_id!r} was cancelled by its decode worker", "cancelled")
        if not self.host.agent.has_peer(pr.dst_agent, pr.dst_instance_id):
            raise Refused(f"no handshake with {pr.dst_agent} instance {pr.dst_instance_id}", "unknown_peer")
        live = self.outbound.get(pr.req_id)
        if live is not None:  # the registration in flight keeps the request, its pages and its notice
            if live.transfer.peer == pr.dst_agent and live.transfer.session.peer_instance == pr.dst_instance_id:
                raise Refused(f"duplicate request id {pr.req_id!r}: already on its way to you", "duplicate_request")
            raise Refused(f"request id {pr.req_id!r} is in use by another decode worker's", "request_id_in_use")
        # Checked here, not when the first chunk is posted: a bad page id raised inside a scheduler
        # step would take the engine process (and every request on it) down.
        dst_pool = self.host.agent.peer(pr.dst_agent).num_pages
        if any(p < 0 or p >= dst_pool for p in pr.dst_pages):
            raise Refused(f"dst_pages must lie in [0, {dst_pool}) (the peer's pool)", "invalid_request")
        dst = torch.tensor(pr.dst_pages, dtype=torch.int64)
        if dst.numel() != -(-len(pr.token_ids) // self.host.page_size):
            raise Refused("dst_pages does not cover the prompt", "invalid_request")
        sampling = replace(pr.sampling, max_tokens=1)
        req = self.host.make_req(pr.req_id, pr.token_ids, sampling, received, prefill_only=True)
        try:
            self.host.enqueue(req)  # raises RequestRejected (-> a refusal) before anything is registered
        except RequestRejected:
            self.host.stamps.pop(pr.req_id, None)
            raise
        self.outbound[pr.req_id] = Outbound(req, open_request(self.sender, pr.req_id, pr.dst_agent, pr.deadline_s), dst)

    # ---- the connector's asks: the chunk's KV is in memory when they come ---------------------------
    def _unsent(self, ob: Outbound, upto_pages: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (local, peer) pages computed up to `upto_pages` and not posted yet; None when nothing is due."""
        if ob.transfer.state not in (S.REQUESTED, S.WRITING) or upto_pages <= ob.sent_pages:
            return None
        src = torch.tensor(ob.req.pages[ob.sent_pages : upto_pages], dtype=torch.int64)
        dst = ob.dst_pages[ob.sent_pages : upto_pages]
        ob.sent_pages = upto_pages
        return src, dst

    def _post(self, ob: Outbound, upto_pages: int) -> None:
        pages = self._unsent(ob, upto_pages)
        if pages is None:
            return
        try:
            ob.transfer.post(*pages)
        except TransferError:
            pass  # the session is given up; `tick` ends the request once its writes settled

    def chunk_done(self, req: Req, start: int, end: int) -> None:
        ob = self.outbound.get(req.req_id)
        if ob is not None and end < req.prompt_len:
            self._post(ob, end // self.host.page_size)  # complete pages only; the rest goes with the next chunk

    def prefill_done(self, req: Req) -> bool:
        """Posts the rest of the prompt's pages and the "landed" notice; True: the scheduler holds the pages
        until the session ends (`_finish`)."""
        ob = self.outbound.get(req.req_id)
        if ob is None:
            return False
        ob.computed = True
        ob.first_token_at = time.monotonic()
        self.host.note_admissions()  # a prompt admitted and done in this very step: its admission goes in the notice
        self.host.mark(req.req_id, "prefill_first_token")
        if ob.transfer.state not in (S.REQUESTED, S.WRITING):
            return True
        notice = KVNotice(
            req_id=req.req_id,
            outcome="landed",
            token=req.output_ids[0],
            logprob=req.output_logprobs[0] if req.output_logprobs else None,
            prompt_logprobs=req.prompt_logprobs,
            cached_tokens=req.prefix_hit_len,
            checksums=self.host.runner.kv_checksums(torch.tensor(req.pages, dtype=torch.int64))
            if self.host.debug_checksums
            else None,
            timeline=self.host.stamps.get(req.req_id),
        )
        empty = torch.zeros(0, dtype=torch.int64)
        src, dst = self._unsent(ob, len(ob.dst_pages)) or (empty, empty)
        try:
            # The last pages and the notice in one write where NIXL's ordering allows (RequestTransfer doc).
            ob.transfer.post_final(src, dst, encode(notice))
        except TransferError:
            pass  # the session is given up; `tick` ends the request once its writes settled
        return True

    def aborted(self, req: Req) -> bool:
        """A request given up while its session is open (`abort`) leaves the scheduler at once, computing no
        further chunk, but its pages stay held while a posted write may still read them (until `_finish`)."""
        return req.req_id in self.outbound

    def finished(self) -> FinishedTransfers | None:
        done, self.done = self.done, FinishedTransfers()
        return done

    # ---- progress --------------------------------------------------------------------------------
    def tick(self) -> None:
        self.sender.progress()
        now = time.monotonic()
        for rid in list(self.outbound):
            if self.outbound[rid].transfer.progress(now) in TERMINAL:
                self._finish(rid)

    def _finish(self, rid: str) -> None:
        """The session is terminal: no posted write reads the request's pages any more; give them back."""
        ob = self.outbound.pop(rid)
        t = ob.transfer
        if ob.req.finished:  # prefilled, or given up: the scheduler holds its pages (`prefill_done`, `aborted`)
            self.done.released.append(rid)  # the scheduler frees them when it next asks
        else:
            self.host.scheduler.abort(rid, reason="error", error=t.error)
        stamps = self.host.stamps.pop(rid, None)
        if t.state is S.LANDED:
            self.stats["descs"] += t.num_descs
            self.stats["bytes"] += t.num_bytes
            self.stats["transfers"] += 1
            self.host.outbox.append(
                PrefillDone(rid, t.num_descs, ob.req.prefix_hit_len, stamps, self._transfer_figures(ob))
            )
        else:
            self.host.outbox.append(PrefillError(rid, t.error or "transfer failed"))

    @staticmethod
    def _transfer_figures(ob: Outbound) -> TransferFigures:
        """The landed transfer's figures for the control plane's histograms (common/worker/engine_metrics.py)."""
        t = ob.transfer.timing()
        first, last, landed = t.first_post, t.last_done, t.landed
        span = None
        if first is not None and landed is not None:  # wall clock, for the trace's transfer span
            to_wall = time.time() - time.monotonic()
            span = (first + to_wall, landed + to_wall)
        return TransferFigures(
            peer=ob.transfer.peer,
            bytes=t.bytes,
            writes=t.writes,
            seconds=max(0.0, last - first) if first is not None and last is not None else None,
            tail=max(0.0, landed - ob.first_token_at) if landed is not None and ob.first_token_at is not None else None,
            span=span,
        )

    def abort(self, req_id: str, reason: str, error: str | None) -> None:
        ob = self.outbound.get(req_id)
        if ob is None:
            return
        # It stops at the next chunk boundary: out of the scheduler now, its pages held there while the posted
        # writes may still read them (`aborted`), released by `_finish` once they settled ("closed" goes out).
        if ob.transfer.cancel(error or "aborted by the decode worker") in TERMINAL:
            self._finish(req_id)
        elif not ob.req.finished:
            self.host.scheduler.abort(req_id, reason="abort", error=error)
