"""Float64 references for the GEMV kernels' prologues and epilogues, shared by the GPU tests
(tests/test_gpu_kernels.py) and the CPU interpreter run (tests/gemv_interpreted.py)."""

from __future__ import annotations

import torch

from common.engine.fp8 import quantize_rows


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def weight_operand(w: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(the GEMV's weight, its per-row scales or None, the float64 weight it stands for): FP8 weights as the FP8
    model holds them (e4m3, one scale per output row), the reference their dequantized values."""
    if not fp8:
        return w, None, w.double()
    q, scale = quantize_rows(w)
    scale = scale.flatten()
    return q, scale, q.double() * scale.double()[:, None]


def silu_mul64(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [gate | up], in float64."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def rms_norm64(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    s = s.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
