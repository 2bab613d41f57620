"""The FP8 conversions the GPU path runs: common/engine/gpu/fp8_quant.py's Triton kernels on a CUDA tensor where
Triton is, else the same numbers from common/engine/fp8.py's torch ops (composed with the 16-bit op they absorb)."""

from __future__ import annotations

import torch

from common.engine import fp8
from common.engine.layers import rms_norm, silu_and_mul

try:
    from common.engine.gpu import fp8_quant
except ImportError:  # no Triton
    fp8_quant = None  # type: ignore[assignment]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, float32 scale per row `[M, 1]`)."""
    if fp8_quant is not None and x.is_cuda:
        return fp8_quant.quantize_rows(x)
    return fp8.quantize_rows(x)


def add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(quantize_rows(rms_norm(residual + x)), the residual stream): `residual` is updated in place; None starts the
    stream at x."""
    if fp8_quant is not None and x.is_cuda and x.shape[-1] <= fp8_quant.NORM_MAX:
        return fp8_quant.add_rms_norm_quant(x, residual, weight, eps)
    if residual is None:
        stream = x
    else:
        stream = residual.add_(x)
    xq, sx = fp8.quantize_rows(rms_norm(stream, weight, eps))
    return xq, sx, stream


def silu_mul_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(silu(gate) * up) for gate_up = [gate | up]."""
    if fp8_quant is not None and gate_up.is_cuda:
        return fp8_quant.silu_mul_quant(gate_up)
    return fp8.quantize_rows(silu_and_mul(gate_up))


def saturate(x: torch.Tensor) -> torch.Tensor:
    """x as e4m3 at scale 1.0, saturated at +-448."""
    if fp8_quant is not None and x.is_cuda:
        return fp8_quant.saturate(x)
    return fp8.to_fp8(x)
