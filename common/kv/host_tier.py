"""The prefix cache's second tier: KV pages in host memory behind the device pool.

When the radix cache must free device pages it copies its least recently used entries here instead of
dropping them (common/kv/radix.py: `evict`), and a later prompt that matches them has them copied back into
fresh device pages before its prefill (`load_back`), so it computes only the uncached suffix. A host page
costs a PCIe copy to reuse, about a tenth of the prefill that recomputing it costs (bench/RESULTS.md, "Figures behind choices in the code"), so the tier pays off whenever distinct prefixes outgrow the device pool.

The host pool has the device pool's layout (`[pages, layers, kv_parts, page_size, heads, head_dim]`), so a run of
consecutive pages is one copy each way, and its own free-page stack. On CUDA it is page-locked (registered
with the driver) and every copy is issued on the current stream without waiting: the scheduler runs one
stream, so a copy out is ordered after the steps that wrote the page and before any later step that reuses
the device page, and a copy back is ordered before the prefill that reads it; nothing on the host reads
the tier's memory. On the CPU the "device" pool is host memory too: the tier is a second, separate tensor
with the same code path and the same limits, and its copies are synchronous.

The tier is exclusive: a page lives on the device or on the host, never both, so each tier's ledger is
simply free + cached == total.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence

import torch

from common.kv.allocator import PageAllocator
from common.kv.pool import KVPool

log = logging.getLogger("kvferry.kv")

# Share of the worker's usable memory (its cgroup limit, or what the machine has available) that an unset
# KVFERRY_HOST_KV_GB gives the tier on a GPU. The rest is the process itself (weights are loaded by then,
# but tokenizers, NIXL buffers and the Python heap grow) and whatever else the pod runs.
AUTO_HOST_SHARE = 0.3


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
    """Memory this process may still use: the cgroup's limit (v2, else v1) when one is set, capped by what
    the machine has available now."""
    available = _mem_available_bytes()
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        limit = _read_int(path)
        if limit is not None and 0 < limit < (1 << 60):
            return min(limit, available) if available else limit
    return available


def host_tier_bytes(host_kv_gb: float, device_type: str) -> int:
    """Bytes for the tier: `host_kv_gb` GiB when >= 0 (0: no tier), else chosen here: on a GPU a share of
    the usable host memory (`AUTO_HOST_SHARE`), on the CPU none (the device pool is host memory already;
    set it to give the CPU the same two tiers a GPU has)."""
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


class HostTier:
    """A host-memory KV pool with its own page allocator, and the copies between it and the device pool."""

    def __init__(self, device_pool: KVPool, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("a host tier needs at least one page")
        layout = device_pool.layout
        self.device_pool = device_pool
        shape = (num_pages, *layout.page_shape)
        # empty, not zeros: the kernel commits the memory as pages are first written (a tier that is never
        # filled costs nothing); registration below commits it all on CUDA.
        kv = torch.empty(shape, dtype=layout.dtype)
        self._unregister: weakref.finalize | None = None
        if device_pool.device.type == "cuda" and self._register(kv):
            # A tier dropped without `close` (a scheduler replaced in one process) must not leave its memory
            # page-locked: torch would reuse the range, and registering it again fails ("already mapped").
            self._unregister = weakref.finalize(self, _unregister, kv)
        self.pool = KVPool(layout, num_pages, "cpu", kv)
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages
        self.saved_pages = 0  # pages copied out of the device pool, since start
        self.loaded_pages = 0  # pages copied back into it

    @staticmethod
    def _register(kv: torch.Tensor) -> bool:
        """Page-locks the tensor in place. Registration rather than a pinned allocation: torch's pinned
        allocator rounds every block up to a power of two, which would waste up to half of a large tier."""
        rc = torch.cuda.cudart().cudaHostRegister(kv.data_ptr(), kv.numel() * kv.element_size(), 0)
        if int(getattr(rc, "value", rc)) != 0:
            # The failed call left CUDA's last-error set; the next kernel launch would report it as its own
            # failure (seen: a 127 GiB tier on a 128 GiB host made the scheduler's first allocation "fail").
            # A launch here consumes it.
            try:
                torch.zeros(1, device="cuda")
            except Exception:
                pass
            log.warning("host KV tier: page-locking failed (%s); copies will not overlap with compute", rc)
            return False
        return True

    def save(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> None:
        """Copies device pages into host pages (asynchronous on CUDA, ordered on the current stream)."""
        self._copy(self.device_pool.kv, device_pages, self.pool.kv, host_pages)
        self.saved_pages += int(device_pages.numel())

    def load(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> None:
        """Copies host pages into device pages (asynchronous on CUDA, ordered on the current stream)."""
        self._copy(self.pool.kv, host_pages, self.device_pool.kv, device_pages)
        self.loaded_pages += int(host_pages.numel())

    def _copy(self, src: torch.Tensor, src_pages: torch.Tensor, dst: torch.Tensor, dst_pages: torch.Tensor) -> None:
        for s, d, n in page_runs(src_pages.tolist(), dst_pages.tolist()):
            dst[d : d + n].copy_(src[s : s + n], non_blocking=True)

    def close(self) -> None:
        if self._unregister is not None:
            self._unregister()  # once: a finalizer runs at most one time


def _unregister(kv: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(kv.data_ptr())


def make_host_tier(device_pool: KVPool, host_kv_gb: float, tp_size: int = 1) -> HostTier | None:
    """The tier a scheduler gets from its setting (None: no tier).

    Tensor-parallel workers run without one: every rank holds its own heads of each page, and the copies
    would have to be replayed on every rank in step with rank 0's evictions."""
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
    log.info(
        "host KV tier",
        extra={"host_pages": pages, "host_gb": round(nbytes / (1 << 30), 2), "pid": os.getpid()},
    )
    return tier
