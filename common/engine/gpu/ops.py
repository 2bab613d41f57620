"""`FlashInferOps`: the model's ops (common/engine/layers.py `Ops`) on the GPU in 16 bits."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from common.engine.layers import ComposedOps


class FlashInferOps(ComposedOps):
    """The GPU in bfloat16/float16: flashinfer's fused add + RMSNorm (in place) and SiLU-mul around cuBLAS,
    and for small decode batches Triton GEMVs that stream the weight with the op before them folded in
    (common/engine/gpu/fused_gemv.py). Where each wins (bench/decode_kernels.py, H200, llama-3.1-8b shapes):
    - norm + GEMM (qkv, gate_up, LM head), up to `gemv_max_rows` rows: equal to cuBLAS or 4-10% faster, and the
      norm kernel is gone;
    - plain and SiLU-mul GEMMs (o, down): 10-20% faster than cuBLAS at one row, but the few-row kernel is up to
      17% slower on down's long K, so those stay with cuBLAS above one row.
    `gemv_max_rows` 0 turns the Triton GEMVs off."""

    def __init__(self, gemv_max_rows: int = 0) -> None:
        # The CUDA norm kernels (what the bundle precompiles), not the CuTe-DSL ones; read at flashinfer's import.
        os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
        import flashinfer

        self.fi = flashinfer
        self.gemv_max_rows = gemv_max_rows
        self.gemv = None
        if gemv_max_rows > 0:
            from common.engine.gpu.fused_gemv import MAX_ROWS, gemv  # Triton: imported only when used

            self.gemv = gemv
            self.gemv_max_rows = min(gemv_max_rows, MAX_ROWS)

    def _fused(self, x: torch.Tensor, max_rows: int | None = None) -> bool:
        limit = self.gemv_max_rows if max_rows is None else min(max_rows, self.gemv_max_rows)
        return self.gemv is not None and 0 < x.shape[0] <= limit

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.fi.rmsnorm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.fi.fused_add_rmsnorm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.fi.silu_and_mul(gate_up)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._fused(x, max_rows=1):
            return self.gemv(x, weight, bias)[0]  # type: ignore[misc]
        return F.linear(x, weight, bias)

    def norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fused(x):
            return super().norm_linear(x, residual, norm_weight, eps, weight, bias, packed)
        if residual is None:
            return self.gemv(x, weight, bias, prologue="norm", norm_weight=norm_weight, eps=eps)[0], x  # type: ignore[misc]
        y, new_residual = self.gemv(  # type: ignore[misc]
            x, weight, bias, prologue="add_norm", residual=residual, norm_weight=norm_weight, eps=eps
        )
        return y, new_residual

    def silu_linear(
        self, gate_up: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self._fused(gate_up, max_rows=1):
            return self.gemv(gate_up, weight, prologue="silu")[0]  # type: ignore[misc]
        return super().silu_linear(gate_up, weight, packed)
