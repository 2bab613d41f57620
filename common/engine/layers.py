"""Plain torch building blocks of the decoder; the GPU backend swaps fused kernels in through `Ops`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.engine.model_config import RopeConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype) if x.dtype != torch.float32 else xf * weight


def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A CPU float32 `[out, in]` weight reordered into oneDNN's blocked GEMM layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear`, through oneDNN with a pre-packed weight when one is given (CPU float32)."""
    if packed is not None and x.shape[0] > 0:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths scaled down, short kept, smooth between.
        low_wl = rope.original_max_position / rope.low_freq_factor
        high_wl = rope.original_max_position / rope.high_freq_factor
        wl = 2 * math.pi / inv
        smooth = (rope.original_max_position / wl - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        scaled = torch.where(wl > low_wl, inv / rope.factor, inv)
        mid = (wl <= low_wl) & (wl >= high_wl)
        scaled = torch.where(mid, (1 - smooth) * inv / rope.factor + smooth * inv, scaled)
        inv = scaled
    return inv.float()


@dataclass
class RotaryCache:
    """cos/sin for every position up to max_position, looked up by position ids (neox half-split style)."""

    cos: torch.Tensor  # [max_pos, head_dim // 2]
    sin: torch.Tensor

    @classmethod
    def build(cls, head_dim: int, rope: RopeConfig, max_position: int, device: torch.device) -> RotaryCache:
        inv = rope_inv_freq(head_dim, rope)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        return cls(cos=freqs.cos().to(device), sin=freqs.sin().to(device))

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)
