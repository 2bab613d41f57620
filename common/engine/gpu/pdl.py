"""Programmatic dependent launch (PDL, Hopper and later) for the GPU path's Triton kernels: a kernel starts once
the one before has called `release_next` (first thing) and calls `wait_prior` before touching memory, so launch
and set-up overlap the earlier kernel. Waiting is transitive, so stream order holds after the waits. No kernel
prefetches weights before its wait: that measured slower.
"""

from __future__ import annotations

import triton
import triton.language as tl


def triton_launches_pdl() -> bool:
    """This Triton launches kernels with PDL (the GPU's side: common/engine/gpu/path.py `pdl_available`)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return hasattr(tl.extra.cuda, "gdc_wait") and "launch_pdl" in CUDAOptions.__dataclass_fields__


def launch_options(on: bool) -> dict[str, bool]:
    """A Triton launch's keyword arguments for PDL (none when off: an older Triton takes no such option)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def release_next():
    """The next kernel (launched with PDL) may start once every program of this one has been here."""
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_prior():
    """Returns once the kernel before this one has finished and its memory is visible."""
    tl.extra.cuda.gdc_wait()


@triton.jit
def start(PDL: tl.constexpr):
    """A kernel's first step with PDL on (nothing with it off): the next kernel may start, then this one waits."""
    if PDL:
        release_next()
        wait_prior()
