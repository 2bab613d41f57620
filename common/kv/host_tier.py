"""The prefix cache's second tier: KV pages in host memory behind the device pool (docs/architecture.md, "Host
KV tier"). Same page layout as the device pool, so a run of pages is one copy; copies are issued on the one
scheduler stream without waiting, which orders them against the steps. Exclusive: a page is in one tier.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from common.kv.allocator import PageAllocator
from common.kv.pool import KVPool

log = logging.getLogger("kvferry.kv")

# Share of the usable host memory an unset KVFERRY_HOST_KV_GB gives the tier on a GPU (the process grows too).
AUTO_HOST_SHARE = 0.3
# Page-locking runs in pieces of this size in the engine loop's idle turns (`lock_some`), and a turn stops between
# pieces as soon as a command is waiting: a request that arrives meanwhile waits for the piece under way, not for
# the whole tier (tens of GB: seconds). Registering took 11.15 s for 37 GB on an H200 host (~3.3 GB/s, the pages
# committed as they are pinned), so a 32 MiB piece is ~10 ms. With 128 MiB pieces and a turn that locked until its
# 50 ms were spent (two pieces, ~80 ms), a P+D pair's prefill worker, idle between prompts, took its requests
# 36-45 ms late on average (H100, 3 req/s: the stages between `prefill_received` and `prefill_engine_received`).
# A copy is cut at each piece's edge (`within_pieces`): a few more copy calls of microseconds each.
LOCK_CHUNK_BYTES = 32 << 20
# The OS page: registrations are made of whole ones.
HOST_PAGE_BYTES = mmap.PAGESIZE


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def usable_host_memory_bytes() -> int:
    """Memory this process may still use: the cgroup limit (v2, else v1), capped by what is available now."""
    available = _mem_available_bytes()
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        limit = _read_int(path)
        if limit is not None and 0 < limit < (1 << 60):
            return min(limit, available) if available else limit
    return available


def host_tier_bytes(host_kv_gb: float, device_type: str) -> int:
    """Bytes for the tier: `host_kv_gb` GiB when >= 0 (0: none), else on a GPU `AUTO_HOST_SHARE` of the usable
    host memory, on the CPU none."""
    if host_kv_gb >= 0:
        return int(host_kv_gb * (1 << 30))
    if device_type != "cuda":
        return 0
    return int(AUTO_HOST_SHARE * usable_host_memory_bytes())


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both page lists are consecutive: one copy each."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s0 + n == s and d0 + n == d:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def within_pieces(runs: list[tuple[int, int, int]], piece_pages: int, host_is_dst: bool) -> list[tuple[int, int, int]]:
    """`runs` cut where their host side crosses from one piece of `piece_pages` pages into the next. CUDA takes a
    copy from or to page-locked memory only within one registration (`cudaHostRegister`): a run spanning two
    pieces fails with "invalid argument"."""
    out: list[tuple[int, int, int]] = []
    for s, d, n in runs:
        while n > 0:
            host = d if host_is_dst else s
            take = min(n, piece_pages - host % piece_pages)
            out.append((s, d, take))
            s, d, n = s + take, d + take, n - take
    return out


class HostTier:
    """A host-memory KV pool with its own page allocator, and the copies between it and the device pool.

    On a GPU the tier's memory is page-locked (asynchronous copies need it) after the engine is ready, piece by
    piece in its idle turns (`lock_some`), not at start: locking 30% of a machine's memory takes seconds that a
    new pod would otherwise spend not ready. Until every piece is locked the tier is not `ready` and the prefix
    cache runs as if it had none (nothing is on the host yet, so nothing is lost)."""

    def __init__(
        self, device_pool: KVPool, num_pages: int, lock_pages: Callable[[int, int], bool] | None = None
    ) -> None:
        if num_pages <= 0:
            raise ValueError("a host tier needs at least one page")
        layout = device_pool.layout
        self.device_pool = device_pool
        shape = (num_pages, *layout.page_shape)
        # empty, not zeros: the memory is committed as pages are first written (registration commits it on CUDA).
        kv = torch.empty(shape, dtype=layout.dtype)
        if lock_pages is None and device_pool.device.type == "cuda":
            lock_pages = _cuda_register
        # (address, bytes) of each piece still to lock, and the pages a piece holds; on the CPU path nothing is
        # locked and nothing is cut: no piece, one piece's worth of pages.
        self._to_lock: list[tuple[int, int]] = []
        self._piece_pages = num_pages
        self._page_bytes = stride = kv.stride(0) * kv.element_size()
        if lock_pages is not None:
            # Pieces of whole KV pages, so a copy is cut only between pages (`within_pieces`), and of whole OS
            # pages, so no OS page is registered twice (a latent page of DeepSeek-V2-Lite is 121.5 OS pages).
            unit = HOST_PAGE_BYTES // math.gcd(stride, HOST_PAGE_BYTES)  # KV pages per whole number of OS pages
            self._piece_pages = max(unit, LOCK_CHUNK_BYTES // stride // unit * unit)
            self._to_lock = [
                (kv.data_ptr() + p * stride, min(self._piece_pages, num_pages - p) * stride)
                for p in range(0, num_pages, self._piece_pages)
            ]
        self._lock_pages = lock_pages
        self._locked: list[int] = []  # addresses of the pieces locked, to unlock at close
        # pages in pieces still to lock (/load's host_pages_locked is the rest): all of them until the first turn
        self.unlocked_pages = num_pages if self._to_lock else 0
        self.lock_seconds = 0.0  # spent locking so far
        self._unregister: weakref.finalize | None = None
        if lock_pages is _cuda_register:
            # A tier dropped without `close` must not stay page-locked: registering the reused range would fail.
            self._unregister = weakref.finalize(self, _unregister, self._locked, kv)
        self.pool = KVPool(layout, num_pages, "cpu", kv)
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages
        self.saved_pages = 0  # pages copied out of the device pool, since start
        self.loaded_pages = 0  # pages copied back into it

    @property
    def ready(self) -> bool:
        """Every piece locked (or given up on after a failure): the prefix cache may move pages here."""
        return not self._to_lock

    def lock_some(self, budget_s: float, waiting: Callable[[], bool] | None = None) -> bool:
        """Locks at least one piece, then more while the next would end within `budget_s` (at the pieces' mean
        time so far) and `waiting()` (a command has come in) stays false; True while some remain. Logs once, as
        the last piece is locked (nothing to lock: returns at once, says nothing)."""
        if not self._to_lock:
            return False
        started = time.perf_counter()
        locked = 0
        while self._to_lock:
            address, nbytes = self._to_lock[0]
            if not self._lock_pages(address, nbytes):  # type: ignore[misc]
                # Copies to unlocked memory are still correct, only not overlapped: serve on, lock no more.
                log.warning("host KV tier: page-locking failed; copies will not overlap with compute")
                self._to_lock.clear()
                break
            self._locked.append(address)
            del self._to_lock[0]
            self.unlocked_pages -= nbytes // self._page_bytes
            locked += 1
            spent = time.perf_counter() - started
            if spent + spent / locked > budget_s or (waiting is not None and waiting()):
                break
        self.lock_seconds += time.perf_counter() - started
        if not self._to_lock:
            gb = round(self.num_pages * self.device_pool.page_stride_bytes / (1 << 30), 2)
            log.info("host KV tier ready", extra={"host_gb": gb, "lock_s": round(self.lock_seconds, 2)})
        return bool(self._to_lock)

    def save(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> None:
        """Device pages into host pages (asynchronous on CUDA, ordered on the current stream)."""
        self._copy(self.device_pool.kv, device_pages, self.pool.kv, host_pages, host_is_dst=True)
        self.saved_pages += int(device_pages.numel())

    def load(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> None:
        """Host pages into device pages (asynchronous on CUDA, ordered on the current stream)."""
        self._copy(self.pool.kv, host_pages, self.device_pool.kv, device_pages, host_is_dst=False)
        self.loaded_pages += int(host_pages.numel())

    def _copy(
        self, src: torch.Tensor, src_pages: torch.Tensor, dst: torch.Tensor, dst_pages: torch.Tensor, host_is_dst: bool
    ) -> None:
        for s, d, n in self.copy_runs(src_pages.tolist(), dst_pages.tolist(), host_is_dst):
            dst[d : d + n].copy_(src[s : s + n], non_blocking=True)

    def copy_runs(self, src: list[int], dst: list[int], host_is_dst: bool) -> list[tuple[int, int, int]]:
        """(src start, dst start, pages) of the copies that move `src` pages to `dst`: consecutive pages in one,
        none crossing from one locked piece of the host side into the next."""
        return within_pieces(page_runs(src, dst), self._piece_pages, host_is_dst)

    def close(self) -> None:
        if self._unregister is not None:
            self._unregister()  # once: a finalizer runs at most one time


def _cuda_register(address: int, nbytes: int) -> bool:
    """Page-locks in place: torch's pinned allocator rounds to a power of two, wasting up to half a tier."""
    rc = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if int(getattr(rc, "value", rc)) != 0:
        # The failure left CUDA's last-error set, which the next launch would report as its own: consume it.
        try:
            torch.zeros(1, device="cuda")
        except Exception:
            pass
        log.warning("host KV tier: cudaHostRegister failed (%s)", rc)
        return False
    return True


def _unregister(locked: list[int], kv: torch.Tensor) -> None:
    """Unlocks the pieces locked so far (`kv`, their memory, is held until then)."""
    for address in locked:
        torch.cuda.cudart().cudaHostUnregister(address)
    locked.clear()


def make_host_tier(
    device_pool: KVPool, host_kv_gb: float, tp_size: int = 1, defer_lock: bool = False
) -> HostTier | None:
    """The tier a scheduler gets (None: none), page-locked now unless `defer_lock` (then by `lock_some`).
    Tensor-parallel workers run without: copies would have to be replayed on every rank in step with rank 0's
    evictions."""
    nbytes = host_tier_bytes(host_kv_gb, device_pool.device.type)
    if nbytes <= 0:
        return None
    if tp_size > 1:
        if host_kv_gb > 0:
            log.warning("host KV tier: not supported with tensor parallelism (%d ranks); running without", tp_size)
        return None
    pages = nbytes // device_pool.page_stride_bytes
    if pages <= 0:
        return None
    tier = HostTier(device_pool, pages)
    if not defer_lock:
        tier.lock_some(float("inf"))
    log.info(
        "host KV tier",
        extra={"host_pages": pages, "host_gb": round(nbytes / (1 << 30), 2), "pid": os.getpid()},
    )
    return tier
