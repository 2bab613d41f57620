"""FP8 GEMMs on Hopper's FP8 tensor cores: `torch._scaled_mm` with row-wise scales (per output channel and per
token), with fast accumulation as vLLM's and torchao's do. cuBLASLt needs K and N multiples of 16; a weight that
is not runs dequantized through `F.linear`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from common.engine.fp8 import Fp8Linear
from common.engine.gpu.fp8_kernels import quantize_rows

log = logging.getLogger("kvferry.engine")

ALIGN = 16
_warned: set[tuple[int, int]] = set()


def fits(w: Fp8Linear) -> bool:
    n, k = w.weight.shape
    return n % ALIGN == 0 and k % ALIGN == 0


def fp8_linear(x: torch.Tensor, w: Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not fits(w):
        if w.weight.shape not in _warned:
            _warned.add(tuple(w.weight.shape))
            log.warning("FP8 GEMM %s not a multiple of %d: runs dequantized", tuple(w.weight.shape), ALIGN)
        return F.linear(x, w.dequantize(x.dtype), bias)
    xq, sx = quantize_rows(x)
    return scaled_linear(xq, sx, w, bias, x.dtype)


def scaled_linear(
    xq: torch.Tensor, sx: torch.Tensor, w: Fp8Linear, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The FP8 GEMM of activations already quantized per token (`fits(w)`)."""
    n = w.weight.shape[0]
    if xq.shape[0] == 0:
        return torch.empty(0, n, dtype=dtype, device=xq.device)
    y = torch._scaled_mm(xq, w.weight.t(), scale_a=sx, scale_b=w.scale.view(1, n), out_dtype=dtype, use_fast_accum=True)
    return y if bias is None else y.add_(bias)
