"""FP8 (float8 e4m3) numerics shared by the KV cache and the linear layers: one way to quantize.

Values are stored as `x / scale` rounded to e4m3 (3 mantissa bits: a relative step of 1/16 at most) and
clamped to its finite range, +-448 (e4m3fn has no infinity: an overflow would otherwise become NaN on some
devices). A stored value `q` means `q * scale`.

- KV cache: one static scale per layer for K and one for V (`KVLayout.kv_scales`; the checkpoint's
  `k_scale` / `v_scale`, else 1.0). flashinfer's FP8 paged attention takes exactly that, two floats per call,
  folded into the softmax scale and the output, so no kernel reads a scale tensor. Keys and values of the
  models measured stay far inside the range at scale 1.0 (SmolLM2: |K| <= 19, |V| <= 11; per-head or
  per-page scales would need a scale read per page inside the kernels and a second array in every transfer).
- Weights: one scale per output channel (`quantize_rows`), activations one scale per token at each GEMM
  (`quantize_rows` again, dynamic); the product of the two 8-bit operands is rescaled by both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Names of the settings' FP8 choice and of the dtype on the wire (common/transfer/layout.py spells dtypes so).
FP8_SETTING = "fp8_e4m3"
# Rows whose largest magnitude is below this get this as their amax: a zero row must not divide by zero.
MIN_AMAX = 1e-12


# e4m3 on a GPU: FP8 tensor cores (torch's scaled GEMMs) and Triton's e4m3 conversions need Ada or newer.
FP8_MIN_CAPABILITY = (8, 9)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_unsupported(device: torch.device) -> str | None:
    """Why this device cannot run FP8 weights or an FP8 KV cache, or None where it can (the CPU runs the twin)."""
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
    """`x / scale` as e4m3, saturated at +-448 (`scale` a float or a tensor broadcast against x)."""
    y = x.float() if isinstance(scale, float) and scale == 1.0 else x.float() / scale
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale per row `[rows, 1]`): each row's largest magnitude maps to 448. Weights
    `[out, in]` get one scale per output channel this way, activations `[tokens, in]` one per token."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=MIN_AMAX)
    scale = amax / FP8_MAX
    return to_fp8(x, scale), scale


def store_rows(rows: torch.Tensor, index: torch.Tensor, values: torch.Tensor, scale: float = 1.0) -> None:
    """`rows[index] = values` in the pool's dtype; into an FP8 pool as `values / scale`. FP8 goes through a byte
    view: the CPU has no float8 `index_copy_`, and bytes are what the pool holds anyway."""
    if is_fp8(rows.dtype):
        rows.view(torch.uint8).index_copy_(0, index, as_stored(values, rows.dtype, scale).view(torch.uint8))
    else:
        rows.index_copy_(0, index, values.to(rows.dtype))


def as_stored(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`x` as `store_rows` writes it into a pool of `dtype` (FP8: `x / scale`, rounded)."""
    return to_fp8(x, scale) if is_fp8(dtype) else x.to(dtype)


@dataclass(frozen=True)
class Fp8Linear:
    """A linear layer's weight in FP8: e4m3 `weight` `[out, in]` and one float32 `scale` per output channel
    `[out]` (W = weight * scale[:, None]). What the ops receive where a 16-bit model passes its weight."""

    weight: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.scale[:, None]).to(dtype)


def fp8_linear_reference(x: torch.Tensor, w: Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T with x quantized per token and W per output channel, both e4m3, computed by dequantizing in
    float32: the CPU twin of an FP8 tensor-core GEMM (the same operands, exact float32 products)."""
    xq, sx = quantize_rows(x)
    y = (xq.float() @ w.weight.float().t()) * sx * w.scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
