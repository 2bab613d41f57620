"""Prefill side: WRITE KV pages into a decode peer's reserved pages, and tell it when they landed.

One NIXL request per write, one descriptor per run of consecutive pages (the pool is page-major, so a
contiguous reservation is one descriptor: posting costs per descriptor). A write is settled once NIXL has let
go of it (completed, failed or cancelled, and released): only then can it touch neither side's pages.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import torch
from nixl._api import nixl_xfer_handle

from common.transfer.agent import KVTransferAgent
from common.transfer.descs import PageRuns, block_descs, check_pages, page_runs, run_descs
from common.transfer.routes import HeadRoute

log = logging.getLogger(__name__)

PollState = Literal["pending", "done", "error"]


class TransferError(RuntimeError):
    """A request's transfer failed or ran past its deadline; the decode side must not be told it is ready."""


class StagingBusy(Exception):
    """No staging space now (earlier packed writes still read theirs); nothing was posted: retry on a later turn."""


@dataclass
class TransferHandle:
    """One posted NIXL WRITE; `num_descs` counts toward the posting-cost budget."""

    peer: str
    peer_instance: str
    num_pages: int
    num_runs: int
    num_descs: int
    num_bytes: int
    posted_at: float
    state: PollState = "pending"
    error: str | None = None
    done_at: float | None = None
    xfers: list[nixl_xfer_handle] = field(default_factory=list, repr=False)  # NIXL requests not yet released
    staged: list[tuple[int, int]] = field(default_factory=list, repr=False)  # staging (offset, bytes) it reads

    @property
    def settled(self) -> bool:
        """NIXL has let go of every request of this write: it can no longer touch any page."""
        return self.state != "pending" and not self.xfers


class RankWrites(Protocol):
    """The writes other tensor-parallel ranks of this worker post for a request: the notice waits for them, a
    give-up aborts them and waits for them to settle."""

    def post(self, req_id: str, peer: str, src: torch.Tensor, dst: torch.Tensor, expect_instance: str) -> None: ...

    def state(self, req_id: str) -> tuple[PollState, str | None]:
        """("pending" | "done" | "error", the error) over every write posted for `req_id` so far."""
        ...

    def settled(self, req_id: str) -> bool: ...

    def abort(self, req_id: str) -> None: ...

    def forget(self, req_id: str) -> None: ...


class KVSender:
    """Posts, polls and releases WRITEs to decode peers (fault-injecting twin: common/transfer/delayed_sender.py)."""

    def __init__(self, agent: KVTransferAgent, ranks: RankWrites | None = None) -> None:
        self.agent = agent
        self.ranks = ranks  # the other ranks' writes of each request, where they post their own (RankWrites)
        self._unsettled: list[TransferHandle] = []  # finished or failed, still held by NIXL: retried each turn
        self._staged_pending: list[TransferHandle] = []  # in flight, reading from the staging area
        self._posted: list[TransferHandle] = []  # every handle not yet settled, for `writes_in_flight`
        self.posts_deferred = 0  # writes put off for want of staging space (``StagingBusy``), for the stats
        self._staging_frees = 0  # how often a released write gave its staging space back
        # (frees seen, bytes asked) when a write last found no room: a write as large is put off until space is freed.
        self._busy_at: tuple[int, int] | None = None

    def post_write(
        self,
        peer: str,
        src_pages: torch.Tensor,
        dst_pages: torch.Tensor,
        notif: bytes | None = None,
        *,
        expect_instance: str | None = None,
    ) -> TransferHandle:
        """Posts one WRITE of `src_pages` (local) into `dst_pages` (peer), pairwise, for every peer rank.

        Caller bugs raise; NIXL failures come back as a handle in state "error". `notif` rides on this write
        only; `expect_instance` refuses a peer restarted since the pages were reserved. The source pages must be
        final (on CUDA: the step that wrote them completed), since NIXL reads them from another thread. Peer ranks
        with fewer heads get theirs packed into the staging area first."""
        remote = self.agent.peer(peer)
        local = self.agent.pool_info
        src = torch.as_tensor(src_pages).to("cpu", torch.int64).reshape(-1)
        dst = torch.as_tensor(dst_pages).to("cpu", torch.int64).reshape(-1)
        check_pages(src, local.num_pages, "src")
        check_pages(dst, remote.num_pages, "dst")
        runs = page_runs(src, dst)
        handle = TransferHandle(
            peer=peer,
            peer_instance=remote.instance_id,
            num_pages=int(src.numel()),
            num_runs=runs.count,
            num_descs=runs.count * len(remote.routes),  # one block per run of pages per peer rank
            num_bytes=int(src.numel()) * sum(r.dst.page_stride for r in remote.routes),
            posted_at=time.monotonic(),
        )
        if expect_instance is not None and expect_instance != remote.instance_id:
            return self._fail(handle, f"peer {peer} restarted ({expect_instance} -> {remote.instance_id})")
        if runs.count == 0:
            # Nothing to move (all pages already on the decode side); the notification still goes.
            if notif:
                try:
                    self.agent.nixl.send_notif(peer, notif)
                except Exception as e:
                    return self._fail(handle, f"send_notif: {e}")
            return self._finish(handle, "done")

        packed = [r for r in remote.routes if not r.direct]
        try:
            spaces = iter(self._take_staging(handle, [int(src.numel()) * r.dst.page_stride for r in packed]))
        except TransferError as e:
            return self._fail(handle, str(e))
        nixl = self.agent.nixl
        self._posted.append(handle)
        try:
            # One NIXL request per peer agent: ranks of a GPU peer run their own agents.
            by_agent: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
            for route in remote.routes:
                local_rows, remote_rows = by_agent.setdefault(route.dst.agent_name, ([], []))
                if route.direct:
                    local_rows.append(run_descs(route.src, runs.src_start, runs.length))
                else:
                    local_rows.append(self._stage(route, src, runs, next(spaces)))
                remote_rows.append(run_descs(route.dst, runs.dst_start, runs.length))
            if handle.staged and self.agent.pool.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the packed pages must be in memory before NIXL reads
            for agent_name, (local_rows, remote_rows) in by_agent.items():
                local_descs = nixl.get_xfer_descs(np.concatenate(local_rows), local.mem_type)
                remote_descs = nixl.get_xfer_descs(np.concatenate(remote_rows), remote.pools[0].mem_type)
                xfer = nixl.initialize_xfer(
                    "WRITE",
                    local_descs,
                    remote_descs,
                    agent_name,
                    (notif or b"") if agent_name == peer else b"",
                    backends=[self.agent.backend],
                )
                handle.xfers.append(xfer)
            if handle.staged:
                self._staged_pending.append(handle)
            return self._begin(handle)
        except TransferError as e:
            return self._fail(handle, str(e))
        except Exception as e:  # NIXL raises nixl*Error (NOT_FOUND for unregistered ranges, disconnects)
            return self._fail(handle, f"post failed: {type(e).__name__}: {e}")

    def single_write(self, peer: str, num_pages: int) -> bool:
        """Whether `num_pages` pages to `peer` go out as one NIXL request to one agent: only such a write may carry
        the notice (NIXL orders a notification after its own transfer's data only)."""
        agents = {r.dst.agent_name for r in self.agent.peer(peer).routes}
        return len(agents) == 1 and num_pages <= self.max_pages_per_post(peer)

    def max_pages_per_post(self, peer: str) -> int:
        """Pages one `post_write` may move: all, unless the peer needs packing into the staging area."""
        routes = self.agent.peer(peer).routes
        packed = sum(r.dst.page_stride for r in routes if not r.direct)
        staging = self.agent.staging
        if packed == 0 or staging is None:
            return 1 << 62
        return max(1, staging.capacity // (2 * packed))  # half the area: the next post packs while this one moves

    def _stage(self, route: HeadRoute, src: torch.Tensor, runs: PageRuns, offset: int) -> np.ndarray:
        """Packs the destination rank's heads of `src` pages into staging at `offset`; returns the local rows."""
        staging = self.agent.ensure_staging()
        pool = self.agent.local_pool(route.src.rank)
        n, stride = int(src.numel()), route.dst.page_stride
        layout = pool.layout
        shape = (n, *layout.page_shape[:3], route.dst.kv_heads, layout.head_dim)
        lo = route.head_offset
        packed = staging.view(offset, shape, layout.dtype)
        torch.index_select(pool.kv[..., lo : lo + route.dst.kv_heads, :], 0, src.to(pool.device), out=packed)
        before = torch.cumsum(runs.length, 0) - runs.length  # pages packed ahead of each run
        return block_descs(staging.base_addr + offset, stride, route.src.device_id, before, runs.length)

    def _take_staging(self, handle: TransferHandle, sizes: list[int]) -> list[int]:
        """Staging space for each packed route of one write, all or none (``StagingBusy``)."""
        if not sizes:
            return []
        staging = self.agent.ensure_staging()
        need = sum(sizes)
        if need > staging.capacity:
            raise TransferError(f"{need} bytes to pack exceed the {staging.capacity}-byte staging area")
        if self.staging_blocked and need >= self._busy_at[1]:  # type: ignore[index]
            raise StagingBusy(f"staging area full (transfers to {handle.peer} in flight)")
        for attempt in range(2):
            taken: list[tuple[int, int]] = []
            for nbytes in sizes:
                offset = staging.alloc(nbytes)
                if offset is None:
                    break
                taken.append((offset, nbytes))
            if len(taken) == len(sizes):
                self._busy_at = None
                handle.staged.extend(taken)
                return [offset for offset, _ in taken]
            for offset, nbytes in taken:
                staging.release(offset, nbytes)
            if attempt == 0:
                self._staged_pending = [h for h in self._staged_pending if self.poll(h) == "pending"]
                self.progress()
        self.posts_deferred += 1
        self._busy_at = (self._staging_frees, need)
        raise StagingBusy(f"staging area full (transfers to {handle.peer} in flight)")

    @property
    def staging_blocked(self) -> bool:
        """A write found no staging space and none was freed since: waiting is all that helps."""
        return self._busy_at is not None and self._busy_at[0] == self._staging_frees

    def poll(self, handle: TransferHandle) -> PollState:
        """Non-blocking; a finished handle's NIXL requests are released here (or retried by `progress`)."""
        if handle.state != "pending":
            return handle.state
        if not self.agent.has_peer(handle.peer, handle.peer_instance):
            # The peer was removed or re-added as a new process: its old endpoint is gone.
            self._fail(handle, f"peer {handle.peer} went away")
            return handle.state
        try:
            states = [self.agent.nixl.check_xfer_state(x) for x in handle.xfers]
        except Exception as e:
            self._fail(handle, f"transfer: {type(e).__name__}: {e}")
            return handle.state
        return self._after_start(handle, states).state

    def abort(self, handle: TransferHandle, reason: str = "aborted") -> None:
        """Cancels if in flight (NIXL cancels on release) and marks failed; `settled` says when it let go."""
        if handle.state == "pending":
            self._fail(handle, reason)

    def progress(self) -> None:
        """Retries releasing writes NIXL still holds (every turn)."""
        self._unsettled = [h for h in self._unsettled if self._try_release(h)]
        self._posted = [h for h in self._posted if not h.settled]

    @property
    def writes_in_flight(self) -> int:
        return sum(not h.settled for h in self._posted)

    def send_notif(self, peer: str, message: bytes, *, expect_instance: str | None = None) -> None:
        if expect_instance is not None and not self.agent.has_peer(peer, expect_instance):
            raise TransferError(f"peer {peer} is not instance {expect_instance} any more")
        self.agent.nixl.send_notif(peer, message)

    def close(self) -> None:
        self.progress()
        if self._unsettled:
            log.warning("%d transfer handles could not be released", len(self._unsettled))

    def _begin(self, handle: TransferHandle) -> TransferHandle:
        return self._after_start(handle, self._start(handle))

    def _start(self, handle: TransferHandle) -> list[str]:
        return [self.agent.nixl.transfer(x) for x in handle.xfers]

    def _after_start(self, handle: TransferHandle, states: list[str]) -> TransferHandle:
        if "ERR" in states:
            return self._fail(handle, "transfer reported ERR")
        if all(st == "DONE" for st in states):  # small writes can complete inside the post call
            return self._finish(handle, "done")
        return handle

    def _finish(self, handle: TransferHandle, state: PollState) -> TransferHandle:
        handle.state = state
        handle.done_at = time.monotonic()
        if self._try_release(handle):
            self._unsettled.append(handle)
        return handle

    def _fail(self, handle: TransferHandle, reason: str) -> TransferHandle:
        log.warning("transfer to %s failed: %s", handle.peer, reason)
        handle.error = reason
        return self._finish(handle, "error")

    def _try_release(self, handle: TransferHandle) -> bool:
        """Releases what NIXL lets go of; True while some request is still held."""
        held = []
        for xfer in handle.xfers:
            try:
                xfer.release()
            except Exception as e:  # still active and not cancellable: keep it and retry later
                log.debug("release of transfer to %s deferred: %s", handle.peer, e)
                held.append(xfer)
        handle.xfers = held
        if held:  # the staging space stays taken until all of them let go
            return True
        staged, handle.staged = handle.staged, []
        self._staging_frees += bool(staged)
        for offset, nbytes in staged:
            assert self.agent.staging is not None
            self.agent.staging.release(offset, nbytes)
        return False
