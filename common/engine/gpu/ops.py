"""`FlashInferOps`: the model's ops on the GPU in 16 bits; `GemvOps` holds the GEMM choices over the norm and
activation primitives a subclass gives (flashinfer's, or torch's under Triton's interpreter in tests).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from common.engine.fp8 import Fp8Linear
from common.engine.gpu import fp8_gemm, fp8_kernels
from common.engine.layers import Activated, InStream, KvWrite, Ops, Rotated

# The Triton GEMV indexes a weight with 32-bit offsets: larger ones (a 256k vocabulary LM head) use cuBLAS.
MAX_WEIGHT_ELEMENTS = 1 << 31


class GemvOps(Ops):
    """The GEMMs of small decode batches on Triton GEMVs that stream the weight, cuBLAS otherwise (docs/architecture.md,
    "GPU kernels"): one row on every shape, 2-8 rows on the wide outputs only (where they measured faster);
    `gemv_max_rows` 0: off. The switches pick the fusions: `fold_prologues` (measured slower: off by default),
    `stream_stats` and `gated_epilogue` (one-row norms and SiLU-mul moved into the GEMVs). FP8 tensor-core GEMMs
    take activations already quantized by the op before (common/engine/gpu/fp8_kernels.py)."""

    # Output width from which the few-row Triton GEMV beats cuBLAS (the gate_up and LM-head shapes).
    WIDE_N = 8192

    def __init__(
        self,
        gemv_max_rows: int = 0,
        fold_prologues: bool = False,
        pdl: bool = False,
        stream_stats: bool = True,
        gated_epilogue: bool = True,
        rope_epilogue: bool = True,
    ) -> None:
        self.gemv_max_rows = gemv_max_rows
        self.fold_prologues = fold_prologues
        self.stream_stats = stream_stats
        self.gated_epilogue = gated_epilogue
        self.rope_epilogue = rope_epilogue
        self.pdl = pdl
        self.gemv = None
        if gemv_max_rows > 0:
            from common.engine.gpu.fused_gemv import MAX_ROWS, gemv, kv_write_fits  # Triton: imported only when used

            self.gemv = functools.partial(gemv, launch_pdl=True) if pdl else gemv
            self.gemv_max_rows = min(gemv_max_rows, MAX_ROWS)
            self._kv_write_fits = kv_write_fits

    def _triton(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        rows = x.shape[0]
        if self.gemv is None or rows == 0 or rows > self.gemv_max_rows or weight.numel() >= MAX_WEIGHT_ELEMENTS:
            return False
        return rows == 1 or weight.shape[0] > self.WIDE_N

    def _fp8_gemm(self, x: torch.Tensor, weight: torch.Tensor, packed: object) -> bool:
        """An FP8 weight whose GEMM runs on the tensor cores with per-token activation scales."""
        return isinstance(packed, Fp8Linear) and fp8_gemm.fits(packed) and not self._triton(x, weight)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: torch.Tensor | Fp8Linear | None = None,
    ) -> torch.Tensor:
        if isinstance(packed, Fp8Linear):
            # FP8: the GEMV streams one byte per weight; larger steps run tensor-core GEMMs (fp8_gemm.py).
            if self._triton(x, weight):
                w, scale = _gemv_weight(weight, packed)
                return self.gemv(x, w, bias, weight_scale=scale)[0]  # type: ignore[misc]
            return fp8_gemm.fp8_linear(x, packed, bias)
        if self._triton(x, weight):
            return self.gemv(x, weight, bias)[0]  # type: ignore[misc]
        return F.linear(x, weight, bias)

    def norm_linear(
        self,
        x: torch.Tensor | InStream,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: torch.Tensor | Fp8Linear | None = None,
        gated: bool = False,
        kv_write: KvWrite | None = None,
    ) -> tuple[torch.Tensor | Activated | Rotated, torch.Tensor]:
        rows = residual if isinstance(x, InStream) else x
        assert rows is not None
        if kv_write is not None and not (
            self.rope_epilogue and self._triton(rows, weight) and self._kv_write_fits(rows.shape[0], weight, kv_write)
        ):
            kv_write = None
        if isinstance(x, InStream):
            assert residual is not None
            if not self._triton(residual, weight):
                return super().norm_linear(x, residual, norm_weight, eps, weight, bias, packed)
            w, scale = _gemv_weight(weight, packed)
            gated = gated and self.gated_epilogue and bias is None
            y, _ = self.gemv(  # type: ignore[misc]
                residual,
                w,
                bias,
                prologue="stream_norm",
                norm_weight=norm_weight,
                eps=eps,
                norm_stats=x.sumsq,
                weight_scale=scale,
                gated=gated,
                kv_write=kv_write,
            )
            return (Activated(y) if gated else Rotated(y) if kv_write is not None else y), residual
        if kv_write is not None:  # the norm's own kernel, then the GEMV that rotates and writes K/V
            normed, residual = self.norm(x, residual, norm_weight, eps)
            w, scale = _gemv_weight(weight, packed)
            return Rotated(self.gemv(normed, w, bias, weight_scale=scale, kv_write=kv_write)[0]), residual  # type: ignore[misc]
        if self._fp8_gemm(x, weight, packed):
            xq, sx, residual = fp8_kernels.add_rms_norm_quant(x, residual, norm_weight, eps)
            return fp8_gemm.scaled_linear(xq, sx, packed, bias, x.dtype), residual  # type: ignore[arg-type]
        if not (self.fold_prologues and self._triton(x, weight)) or isinstance(packed, Fp8Linear):
            return super().norm_linear(x, residual, norm_weight, eps, weight, bias, packed)
        if residual is None:
            return self.gemv(x, weight, bias, prologue="norm", norm_weight=norm_weight, eps=eps)[0], x  # type: ignore[misc]
        y, new_residual = self.gemv(  # type: ignore[misc]
            x, weight, bias, prologue="add_norm", residual=residual, norm_weight=norm_weight, eps=eps
        )
        return y, new_residual

    def project(
        self,
        x: torch.Tensor | Activated,
        weight: torch.Tensor,
        residual: torch.Tensor,
        packed: torch.Tensor | Fp8Linear | None = None,
        silu: bool = False,
    ) -> tuple[torch.Tensor | InStream, torch.Tensor]:
        rows = x.act if isinstance(x, Activated) else x
        # One row only: piecewise-captured steps (16 rows and up) carry plain hidden states across their breaks.
        if not (self.stream_stats and rows.shape[0] == 1 and self._triton(rows, weight)):
            return super().project(x, weight, residual, packed, silu)
        fold = "none"
        if isinstance(x, Activated):
            x = x.act
        elif silu and self.fold_prologues:
            fold = "silu"
        elif silu:
            x = self.silu_and_mul(x)
        w, scale = _gemv_weight(weight, packed)
        stream, sumsq = self.gemv(x, w, prologue=fold, weight_scale=scale, into_stream=residual)  # type: ignore[misc]
        return InStream(sumsq), stream

    def silu_linear(
        self, gate_up: torch.Tensor | Activated, weight: torch.Tensor, packed: torch.Tensor | Fp8Linear | None = None
    ) -> torch.Tensor:
        if isinstance(gate_up, Activated):
            return self.linear(gate_up.act, weight, None, packed)
        if self._fp8_gemm(gate_up, weight, packed):
            xq, sx = fp8_kernels.silu_mul_quant(gate_up)
            return fp8_gemm.scaled_linear(xq, sx, packed, None, gate_up.dtype)  # type: ignore[arg-type]
        if self.fold_prologues and self._triton(gate_up, weight) and not isinstance(packed, Fp8Linear):
            return self.gemv(gate_up, weight, prologue="silu")[0]  # type: ignore[misc]
        return super().silu_linear(gate_up, weight, packed)


class FlashInferOps(GemvOps):
    """The GPU in bfloat16/float16: `GemvOps` over flashinfer's fused add + RMSNorm (in place) and SiLU-mul."""

    def __init__(self, gemv_max_rows: int = 0, **switches: bool) -> None:
        """`switches`: `GemvOps`'s (fold_prologues, pdl, stream_stats, gated_epilogue)."""
        # The CUDA norm kernels (what the bundle precompiles), not CuTe-DSL's; read at flashinfer's import.
        os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
        import flashinfer

        self.fi = flashinfer
        super().__init__(gemv_max_rows, **switches)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.fi.rmsnorm(x, weight, eps, enable_pdl=self.pdl)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.fi.fused_add_rmsnorm(x, residual, weight, eps, enable_pdl=self.pdl)  # residual += x; x = norm(residual)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.fi.silu_and_mul(gate_up, enable_pdl=self.pdl)


def _gemv_weight(
    weight: torch.Tensor, packed: torch.Tensor | Fp8Linear | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(packed, Fp8Linear):
        return packed.weight, packed.scale
    return weight, None
