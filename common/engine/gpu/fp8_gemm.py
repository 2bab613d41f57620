"""FP8 GEMMs on Hopper's FP8 tensor cores: `torch._scaled_mm` with row-wise scales.

y = (x_q @ W_q^T) * s_x[:, None] * s_w[None, :], where W_q is the layer's e4m3 weight with one scale per output
channel (`Fp8Linear`) and x_q the activations quantized per token as the GEMM runs (`quantize_rows`: one Triton
launch, common/engine/gpu/fp8_quant.py, else torch's ops). cuBLASLt's row-wise scaled FP8 GEMM needs the inner dimension and the output width to be multiples of 16; a weight that is not
(none of the supported models' GEMMs) runs dequantized through `F.linear`, logged once.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from common.engine import fp8
from common.engine.fp8 import Fp8Linear

log = logging.getLogger("kvferry.engine")

ALIGN = 16
_warned: set[tuple[int, int]] = set()

try:
    from common.engine.gpu.fp8_quant import quantize_rows
except ImportError:  # no Triton: the same quantization in torch's ops
    quantize_rows = fp8.quantize_rows


def fits(w: Fp8Linear) -> bool:
    n, k = w.weight.shape
    return n % ALIGN == 0 and k % ALIGN == 0


def fp8_linear(x: torch.Tensor, w: Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x `[M, K]` (16-bit) @ the FP8 weight `[N, K]`^T -> `[M, N]` in x's dtype."""
    n = w.weight.shape[0]
    if not fits(w):
        if w.weight.shape not in _warned:
            _warned.add(tuple(w.weight.shape))
            log.warning("FP8 GEMM %s not a multiple of %d: runs dequantized", tuple(w.weight.shape), ALIGN)
        return F.linear(x, w.dequantize(x.dtype), bias)
    if x.shape[0] == 0:
        return x.new_empty(0, n)
    xq, sx = quantize_rows(x)
    y = torch._scaled_mm(xq, w.weight.t(), scale_a=sx, scale_b=w.scale.view(1, n), out_dtype=x.dtype)
    return y if bias is None else y.add_(bias)
