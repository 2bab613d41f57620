"""Programmatic dependent launch (PDL, Hopper and later) for the GPU path's Triton kernels.

A decode step at batch 1 is ~330 kernels, most of them a few microseconds; between two of them the GPU drains
one grid and launches the next. Launched with PDL, a kernel may start as soon as every program of the kernel
before it has called `release_next` (here: first thing), and it calls `wait_prior` before it touches memory the
earlier kernel may write or read: the wait returns once that kernel has finished and its writes are visible.
Launch and set-up overlap the earlier kernel's work, and a GEMV sends its first weight lines to L2
(`prefetch_l2`) before the wait: weights are read-only, so the next GEMV's weights stream while the norm, RoPE
or attention kernels before it run. flashinfer's norm, activation and XQA kernels take part the same way
(their `enable_pdl`). Waiting is transitive (a kernel finishes only after its own wait), so a chain of PDL
kernels keeps stream order for everything after the waits; kernels launched without PDL (cuBLAS, torch ops)
serialize as always.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE_BYTES = 128  # an L2 line: the unit `prefetch_l2` is counted in


def available(device: torch.device) -> bool:
    """Compute capability 9.0 or later and a Triton that launches with PDL (`launch_pdl`, `gdc_wait`)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return hasattr(tl.extra.cuda, "gdc_wait") and "launch_pdl" in CUDAOptions.__dataclass_fields__


def launch_options(on: bool) -> dict[str, bool]:
    """A Triton launch's keyword arguments for PDL (none when off: a Triton without PDL takes no such option)."""
    return {"launch_pdl": True} if on else {}


def prefetch_lines(prefetch_bytes: int, rows: int, row_bytes: int) -> int:
    """128-byte lines per row to prefetch so that `rows` rows take at most `prefetch_bytes` (a power of two, or 0;
    never past a row's end)."""
    lines = min(row_bytes, prefetch_bytes // max(rows, 1)) // LINE_BYTES
    return 1 << (lines.bit_length() - 1) if lines > 0 else 0


@triton.jit
def release_next():
    """The next kernel (launched with PDL) may start once every program of this one has been here."""
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_prior():
    """Returns once the kernel before this one has finished and its memory is visible."""
    tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Brings the lines at `ptrs` (one pointer per line) into L2 without waiting for them."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
