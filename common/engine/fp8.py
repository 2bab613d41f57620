"""FP8 (float8 e4m3) numerics shared by the KV cache and the linear layers: one way to quantize
(docs/architecture.md, "FP8"). A stored `q` means `q * scale`, values saturated at +-448 (e4m3fn has no
infinity: an overflow would become NaN on some devices). KV: one static scale per layer for K and V; weights:
one per output channel; activations: one per token at each GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# The settings' FP8 choice and the dtype's wire name (common/transfer/layout.py).
FP8_SETTING = "fp8_e4m3"
# Rows whose largest magnitude is below this get it as their amax: a zero row must not divide by zero.
MIN_AMAX = 1e-12


# FP8 tensor cores and Triton's e4m3 conversions need Ada or newer.
FP8_MIN_CAPABILITY = (8, 9)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_unsupported(device: torch.device) -> str | None:
    """Why this device cannot run FP8 weights or KV (None: it can; the CPU runs the twin)."""
    if device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    if cap >= FP8_MIN_CAPABILITY:
        return None
    need = ".".join(map(str, FP8_MIN_CAPABILITY))
    return (
        f"FP8 needs a GPU of compute capability {need} or newer (Ada, Hopper, Blackwell); this one is {cap[0]}.{cap[1]}"
    )


def to_fp8(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """`x / scale` as e4m3, saturated at +-448."""
    y = x.float() if isinstance(scale, float) and scale == 1.0 else x.float() / scale
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale per row `[rows, 1]`): each row's largest magnitude maps to 448."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=MIN_AMAX)
    scale = amax / FP8_MAX
    return to_fp8(x, scale), scale


def store_rows(rows: torch.Tensor, index: torch.Tensor, values: torch.Tensor, scale: float = 1.0) -> None:
    """`rows[index] = values` in the pool's dtype (FP8: `values / scale`, through a byte view: the CPU has no
    float8 `index_copy_`)."""
    if is_fp8(rows.dtype):
        rows.view(torch.uint8).index_copy_(0, index, as_stored(values, rows.dtype, scale).view(torch.uint8))
    else:
        rows.index_copy_(0, index, values.to(rows.dtype))


def as_stored(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return to_fp8(x, scale) if is_fp8(dtype) else x.to(dtype)


@dataclass(frozen=True)
class Fp8Linear:
    """A linear weight in FP8: e4m3 `weight` `[out, in]` and float32 `scale` `[out]` (W = weight * scale[:, None])."""

    weight: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.scale[:, None]).to(dtype)


def fp8_linear_reference(x: torch.Tensor, w: Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T with x per token and W per channel in e4m3, dequantized in float32: the CPU twin of the FP8 GEMM."""
    xq, sx = quantize_rows(x)
    y = (xq.float() @ w.weight.float().t()) * sx * w.scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
