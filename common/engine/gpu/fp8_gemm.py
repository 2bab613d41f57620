"""FP8 GEMMs on Hopper's FP8 tensor cores: `torch._scaled_mm` with row-wise scales.

y = (x_q @ W_q^T) * s_x[:, None] * s_w[None, :], where W_q is the layer's e4m3 weight with one scale per output
channel (`Fp8Linear`) and x_q the activations quantized per token: by the op that produces them where one does
(`scaled_linear` after common/engine/gpu/fp8_kernels.py's fused add + RMSNorm or SiLU-mul), else as the GEMM runs
(`fp8_linear`). cuBLASLt's row-wise scaled FP8 GEMM needs the inner dimension and the output width to be multiples
of 16; a weight that is not (none of the supported models' GEMMs) runs dequantized through `F.linear`, logged
once.

The GEMMs run with fast accumulation, as vLLM's and torchao's FP8 inference GEMMs do: Hopper's FP8 MMA keeps its
partial sums in reduced precision, and the default kernel promotes them to float32 every few K steps. Fast
accumulation is faster for a small rise in the error against float32 (bench/fp8_gemm.py; bench/RESULTS.md, "Figures behind choices in the code").
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
    """x `[M, K]` (16-bit) @ the FP8 weight `[N, K]`^T -> `[M, N]` in x's dtype."""
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
    """The FP8 GEMM of activations already quantized per token (e4m3 `[M, K]`, scales `[M, 1]`; `fits(w)`)."""
    n = w.weight.shape[0]
    if xq.shape[0] == 0:
        return torch.empty(0, n, dtype=dtype, device=xq.device)
    y = torch._scaled_mm(xq, w.weight.t(), scale_a=sx, scale_b=w.scale.view(1, n), out_dtype=dtype, use_fast_accum=True)
    return y if bias is None else y.add_(bias)
