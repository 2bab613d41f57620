"""How many CPU threads an engine process gives torch: torch's default (one per host core, whatever the pod's
limit) throttled GPU serving with intra-op threads on tiny tensors, so a GPU engine takes a few; a CPU engine
computes with every core it may use.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

GPU_ENGINE_THREADS = 4


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, quota)) if quota is not None else max(1, cores)


def _cgroup_quota() -> int | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            return math.ceil(int(quota) / int(period))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota_us > 0 and period_us > 0:
            return math.ceil(quota_us / period_us)
    except (OSError, ValueError):
        pass
    return None


def engine_threads(device: str, override: int = 0) -> int:
    """`override` (KVFERRY_TORCH_THREADS) wins when positive; else a few for GPU engines, all cores for CPU ones."""
    if override > 0:
        return override
    cores = usable_cores()
    return min(GPU_ENGINE_THREADS, cores) if device.startswith("cuda") else cores


def apply_engine_threads(device: str, override: int = 0) -> int:
    import torch

    n = engine_threads(device, override)
    torch.set_num_threads(n)
    return n
