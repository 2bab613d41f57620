"""`FlashInferOps`: the model's ops (common/engine/layers.py `Ops`) on the GPU in 16 bits.

`GemvOps` holds the GEMM choices (Triton GEMVs at a few rows, with the norm and activation moved into their
prologues and epilogues; FP8 tensor-core GEMMs above) over the norm and activation primitives a subclass gives:
flashinfer's in `FlashInferOps`; torch's where tests run the GEMVs under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from common.engine.fp8 import Fp8Linear
from common.engine.gpu import fp8_gemm, fp8_kernels
from common.engine.layers import Activated, ComposedOps, InStream, KvWrite, Rotated

# The Triton GEMV indexes a weight with 32-bit offsets: larger ones (a 256k vocabulary x 8192 LM head) use cuBLAS.
MAX_WEIGHT_ELEMENTS = 1 << 31


class GemvOps(ComposedOps):
    """The GEMMs of small decode batches on Triton GEMVs that stream the weight (common/engine/gpu/fused_gemv.py),
    cuBLAS otherwise, over the primitives a subclass gives (rms_norm, add_rms_norm, silu_and_mul). Where the Triton GEMV wins
    (bench/decode_kernels.py, llama-3.1-8b shapes, weights from HBM; bench/RESULTS.md, "Small-batch decode
    kernels"): at one row on every shape; at 2-8 rows only on the wide outputs (gate_up, LM head), so only those
    take it there. `gemv_max_rows` 0 turns the Triton GEMVs off.

    `fold_prologues` also folds the norm (qkv, gate_up, LM head) and SiLU-mul (down) into the GEMV, removing
    their kernels; that was slower (each program recomputes the row's norm; bench/RESULTS.md, "Sixth pass"), so it is off
    unless a benchmark asks for it.

    `stream_stats`: at one row the output projections (o, down) add their output into the residual stream in
    their GEMV's epilogue and leave the stream's sum-of-squares partials there; the next GEMV (qkv, gate_up, the LM
    head) applies the norm from those (`project`, `InStream`): 64 of a 32-layer model's 65 norm kernels go.
    `gated_epilogue`: there the gate_up GEMV also applies silu(gate) * up in its epilogue (`Activated`), and the
    SiLU-mul kernels go too.

    FP8 weights on the tensor-core GEMM (steps larger than the GEMV's rows) take their activations already
    quantized from the op before: the add + RMSNorm and SiLU-mul kernels write e4m3 rows and per-token scales
    (common/engine/gpu/fp8_kernels.py) instead of 16-bit rows that a second kernel would read back to quantize."""

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
        # Programmatic dependent launches (common/engine/gpu/pdl.py) for the GEMVs and flashinfer's kernels alike.
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
            # FP8 weights: the GEMV streams them at one byte each (16-bit activations); larger steps run FP8
            # tensor-core GEMMs with per-token activation scales (common/engine/gpu/fp8_gemm.py).
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
        # One row only: steps captured piecewise (16 rows and more) carry plain hidden states across their breaks.
        if not (self.stream_stats and rows.shape[0] == 1 and self._triton(rows, weight)):
            return super().project(x, weight, residual, packed, silu)
        fold = "none"
        if isinstance(x, Activated):
            x = x.act
        elif silu and self.fold_prologues:
            fold = "silu"
        elif silu:
            x = self.silu_and_mul(x)  # type: ignore[attr-defined]
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
        # The CUDA norm kernels (what the bundle precompiles), not the CuTe-DSL ones; read at flashinfer's import.
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
    """The GEMV's weight operand and its per-row scales: an FP8 weight's own tensor and scales, else `weight`."""
    if isinstance(packed, Fp8Linear):
        return packed.weight, packed.scale
    return weight, None
