"""Per-token FP8 quantization of activations in one launch (common/engine/gpu/fp8_gemm.py uses it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.engine.fp8 import FP8, FP8_MAX, MIN_AMAX


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr
):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX_C) / FP8_MAX_C
    tl.store(s_ptr + row, scale)
    inv = 1.0 / scale
    for k0 in range(0, K, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32) * inv
        v = tl.clamp(v, -FP8_MAX_C, FP8_MAX_C)
        tl.store(q_ptr + row * K + rk, v.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=rk < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, K]` contiguous, float32 scales `[M, 1]`): common/engine/fp8.py's `quantize_rows` in one launch."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m > 0:
        assert x.stride(1) == 1
        _quantize_rows_kernel[(m,)](
            x, q, s, k, x.stride(0), BLOCK=1024, FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, num_warps=4
        )
    return q, s
