"""Programmatic dependent launch (PDL, Hopper and later) for the GPU path's Triton kernels.

A decode step at batch 1 is ~330 kernels, most of them a few microseconds; between two of them the GPU drains
one grid and launches the next. Launched with PDL, a kernel may start as soon as every program of the kernel
before it has called `release_next` (here: first thing), and it calls `wait_prior` before it touches memory the
earlier kernel may write or read: the wait returns once that kernel has finished and its writes are visible.
Launch and set-up overlap the earlier kernel's work. flashinfer's norm, activation and XQA kernels take part
the same way (their `enable_pdl`; its norms and SiLU-mul let their successor start only at their end).
Waiting is transitive (a kernel finishes only after its own wait), so a chain of PDL kernels keeps stream order
for everything after the waits; kernels launched without PDL (cuBLAS, torch ops) serialize as always.

A GEMV could also send its first weight lines to L2 before its wait (weights are read-only): that made FP8
decode at batch 1 slower, whether every GEMV prefetched or only the output projection (which launches while
attention runs), so no kernel prefetches (bench/RESULTS.md, "Fifth pass on the H200").
"""

from __future__ import annotations

import triton
import triton.language as tl


def triton_launches_pdl() -> bool:
    """This Triton launches kernels with PDL (`launch_pdl`, `gdc_wait`); the GPU's side is
    common/engine/gpu/path.py's `pdl_available`."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return hasattr(tl.extra.cuda, "gdc_wait") and "launch_pdl" in CUDAOptions.__dataclass_fields__


def launch_options(on: bool) -> dict[str, bool]:
    """A Triton launch's keyword arguments for PDL (none when off: a Triton without PDL takes no such option)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def release_next():
    """The next kernel (launched with PDL) may start once every program of this one has been here."""
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_prior():
    """Returns once the kernel before this one has finished and its memory is visible."""
    tl.extra.cuda.gdc_wait()
