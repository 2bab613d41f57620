"""The decoder's building blocks: plain torch functions and the two op sets the one forward calls (`TorchOps`;
`FlashInferOps` in common/engine/gpu/ops.py). The `Ops` contract is the fused arrangement (a norm with the GEMM
it feeds, the residual carried beside), so one-row GPU steps run no norm, activation or RoPE kernel between
their GEMVs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.engine.fp8 import Fp8Linear, fp8_linear_reference
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
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | Fp8Linear | None = None,
) -> torch.Tensor:
    """`F.linear`, through oneDNN with a pre-packed weight (CPU float32); an `Fp8Linear` as its FP8 GEMM's twin."""
    if isinstance(packed, Fp8Linear):
        return fp8_linear_reference(x, packed, bias)
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
    elif rope.kind == "yarn":
        inv = _yarn_inv_freq(inv, head_dim, rope)
    return inv.float()


def _yarn_inv_freq(inv: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: frequencies turning under `beta_slow` times over the original context are divided by `factor`,
    those over `beta_fast` kept, a linear ramp between."""

    def dim_of(rotations: float) -> float:
        wavelength_ratio = rope.original_max_position / (rotations * 2 * math.pi)
        return head_dim * math.log(wavelength_ratio) / (2 * math.log(rope.theta))

    low = max(math.floor(dim_of(rope.beta_fast)), 0)
    high = min(math.ceil(dim_of(rope.beta_slow)), head_dim - 1)
    span = (high - low) or 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / span).clamp(0, 1)
    return inv / rope.factor * ramp + inv * (1 - ramp)


@dataclass
class RotaryCache:
    """cos/sin for every position up to max_position, looked up by position ids (neox half-split style)."""

    cos: torch.Tensor  # [max_pos, head_dim // 2]
    sin: torch.Tensor
    _table: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, head_dim: int, rope: RopeConfig, max_position: int, device: torch.device) -> RotaryCache:
        inv = rope_inv_freq(head_dim, rope)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        scale = rope.cos_sin_scale  # YaRN's magnitude correction rides on cos and sin
        return cls(cos=(freqs.cos() * scale).to(device), sin=(freqs.sin() * scale).to(device))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim // 2], the rows of x's positions."""
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)

    def apply(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)

    def cos_sin(self) -> torch.Tensor:
        """flashinfer's table: [max_position, head_dim] float32, cos then sin (shared by attention and qkv GEMMs)."""
        if self._table is None:
            self._table = torch.cat((self.cos, self.sin), dim=-1).float().contiguous()
        return self._table


@dataclass(frozen=True)
class InStream:
    """`Ops.project`'s result when it added the output into the residual stream itself: the stream's per-row
    sum-of-squares partials (float32 `[T, parts]`), which the next norm uses instead of its own pass."""

    sumsq: torch.Tensor

    def rows(self, index: torch.Tensor) -> InStream:
        return InStream(self.sumsq[index])


@dataclass(frozen=True)
class Activated:
    """`norm_linear(..., gated=True)`'s result when its GEMM applied the activation: silu(gate) * up, `[T, I]`."""

    act: torch.Tensor


@dataclass(frozen=True)
class KvWrite:
    """Where a layer's K and V go, for a qkv GEMM that rotates and stores them itself (`kv_write`): pool rows,
    token rows plus this layer's offsets, the static K/V scales, and the RoPE table read at `positions`."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    rows: torch.Tensor
    out_rows: torch.Tensor
    k_offset: int
    v_offset: int
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True)
class Rotated:
    """`norm_linear(..., kv_write=...)`'s result when its GEMM applied RoPE and wrote K/V: the rotated queries."""

    q: torch.Tensor


class Ops:
    """What the decoder forward needs from a backend, composed here from the unfused primitives a subclass gives
    (`rms_norm`, `add_rms_norm`, `silu_and_mul`, `linear`); a subclass overrides what it fuses. Ops may overwrite
    their inputs (flashinfer works in place): callers use only what they return."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, H] or [T, heads, head_dim]."""
        raise NotImplementedError

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x)."""
        raise NotImplementedError

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: torch.Tensor | Fp8Linear | None = None,
    ) -> torch.Tensor:
        """`packed`: the weight's oneDNN copy (CPU float32), or its FP8 form (`Fp8Linear`), else None."""
        raise NotImplementedError

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
        """(linear(rms_norm(residual + x)), residual + x); `residual` None starts the stream at x, an `InStream`
        x is the stream already. `gated` may return `Activated`, `kv_write` may return `Rotated`."""
        normed, residual = self.norm(x, residual, norm_weight, eps)
        return self.linear(normed, weight, bias, packed), residual

    def norm(
        self, x: torch.Tensor | InStream, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x) without a GEMM (what a mixture-of-experts MLP takes)."""
        if isinstance(x, InStream):
            assert residual is not None
            return self.rms_norm(residual, norm_weight, eps), residual
        if residual is None:
            return self.rms_norm(x, norm_weight, eps), x
        return self.add_rms_norm(x, residual, norm_weight, eps)

    def project(
        self,
        x: torch.Tensor | Activated,
        weight: torch.Tensor,
        residual: torch.Tensor,
        packed: torch.Tensor | Fp8Linear | None = None,
        silu: bool = False,
    ) -> tuple[torch.Tensor | InStream, torch.Tensor]:
        """A sublayer's output projection as the pair `norm_linear` takes: (output, residual), or (`InStream`,
        residual + output). One rank only: under tensor parallelism the all-reduce sits before the add."""
        out = self.silu_linear(x, weight, packed) if silu else self.linear(x, weight, None, packed)
        return out, residual

    def silu_linear(
        self, gate_up: torch.Tensor | Activated, weight: torch.Tensor, packed: torch.Tensor | Fp8Linear | None = None
    ) -> torch.Tensor:
        """linear(silu(gate) * up) (or linear of an `Activated`): the MLP's activation and down projection."""
        act = gate_up.act if isinstance(gate_up, Activated) else self.silu_and_mul(gate_up)
        return self.linear(act, weight, None, packed)


class TorchOps(Ops):
    """Plain torch: the CPU path (oneDNN packed GEMMs where packed) and the GPU float32 path."""

    rms_norm = staticmethod(rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)
    linear = staticmethod(linear)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return rms_norm(residual, weight, eps), residual
