"""The device allocator's retries: an allocation the caching allocator could not serve from its cache or a new
segment, so it freed every cached block (synchronizing the device) and tried again. Each is a host stall of up
to tens of ms that no step's work explains, and comes where a batch first reaches a size the pool's reserve
(common/engine/kv_sizing.py) leaves too little room for; published so a stall between steps can be told from a
garbage collection (common/gc_pauses.py)."""

from __future__ import annotations

import torch

__all__ = ["allocator_retries"]


def allocator_retries(device: torch.device) -> int:
    """Retries since the process started on `device` (0 off CUDA). Read from the nested statistics, a top-level
    count there: `memory_stats` would flatten and sort every pool's entries on each load report, 10 a second."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats_as_nested_dict(device).get("num_alloc_retries", 0))
