"""DeepSeek's multi-head latent attention (MLA) on the paged pool: the layer's projections and the torch backend
(docs/architecture.md, "Latent attention (MLA)"). The cache holds one `[latent | k_pe]` entry per token and layer.
Prefill may attend decompressed (keys expanded through `kv_b_proj` once per step); decode attends absorbed
(W_UK folded into the query, the entries read as one shared key head, W_UV applied after), which costs the
expansion once per query instead of per cached token.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.attention import TorchPagedAttention
from common.engine.forward_batch import ForwardBatch
from common.engine.fp8 import as_stored, store_rows
from common.engine.layers import KvWrite, Ops, RotaryCache
from common.engine.model_config import MlaConfig, ModelConfig
from common.kv.pool import KVPool


class MlaParts(NamedTuple):
    """A step's merged input projection split for latent attention, RoPE not yet applied: each head's query
    without and with position (`[T, H, nope]`, `[T, H, rope]`), the normed latent and the shared key's RoPE part."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    latent: torch.Tensor
    k_pe: torch.Tensor


class MlaProjections(nn.Module):
    """One layer's MLA weights beside its merged input projection ([q_a or q; kv_a]) and `o_proj`: the query's
    low-rank norm and up-projection, the latent's norm and `kv_b_proj` `[heads * (nope + v), kv_lora_rank]`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.mla = mla
        self.num_heads = h = cfg.num_heads

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.q_a_norm = param(mla.q_lora_rank) if mla.q_lora_rank else None
        self.q_b_proj = param(h * mla.qk_head_dim, mla.q_lora_rank) if mla.q_lora_rank else None
        self.kv_a_norm = param(mla.kv_lora_rank)
        self.kv_b_proj = param(h * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)

    @property
    def q_rows(self) -> int:
        """Rows of the merged input projection that make the query."""
        return self.mla.q_lora_rank or self.num_heads * self.mla.qk_head_dim

    def split(self, qkv: torch.Tensor, ops: Ops, eps: float) -> MlaParts:
        """The merged projection's output as the parts latent attention takes."""
        mla, t = self.mla, qkv.shape[0]
        q, latent, k_pe = qkv.split((self.q_rows, mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1)
        if self.q_b_proj is not None and self.q_a_norm is not None:
            q = F.linear(ops.rms_norm(q, self.q_a_norm, eps), self.q_b_proj)
        q_nope, q_pe = q.reshape(t, self.num_heads, mla.qk_head_dim).split(
            (mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1
        )
        return MlaParts(q_nope, q_pe, ops.rms_norm(latent, self.kv_a_norm, eps), k_pe)

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.view(self.num_heads, -1, self.mla.kv_lora_rank)
        return w[:, : self.mla.qk_nope_head_dim], w[:, self.mla.qk_nope_head_dim :]

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents as each head's key part without RoPE and value (the decompressed form)."""
        kv = F.linear(latent, self.kv_b_proj).view(latent.shape[0], self.num_heads, -1)
        return kv.split((self.mla.qk_nope_head_dim, self.mla.v_head_dim), dim=-1)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope in latent space, W_UK_h^T q_h: `[T, H, kv_lora_rank]` (the absorbed form)."""
        w_uk, _ = self._up()
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def values_from_latent(self, out: torch.Tensor) -> torch.Tensor:
        """Each head's latent-space output as its value output, W_UV_h o_h (the absorbed form's last step)."""
        _, w_uv = self._up()
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


class MlaBackend(Protocol):
    """What a decoder layer with latent attention needs from its attention backend."""

    def forward_mla(self, layer: int, positions: torch.Tensor, parts: MlaParts, proj: MlaProjections) -> torch.Tensor:
        """RoPE on q_pe and k_pe, this step's entries stored, attention over each request's: `[T, H, v_head_dim]`."""
        ...


class LatentOnly:
    """An MLA backend's answer to the calls a grouped-query layer makes (first in its bases)."""

    def forward(
        self, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        raise TypeError("latent attention layers call forward_mla")

    def kv_write(self, layer: int, positions: torch.Tensor) -> KvWrite | None:
        return None  # the entry is [normed latent | roped k_pe]: not a qkv GEMM's output


class TorchMlaAttention(LatentOnly, TorchPagedAttention):
    """MLA over a latent pool in plain torch, on `TorchPagedAttention`'s layouts: decode steps absorbed, others
    decompressed (`absorbed_decode` False: all decompressed, what tests compare against)."""

    absorbed_decode = True

    def __init__(
        self, pool: KVPool, page_table: torch.Tensor, num_heads: int, mla: MlaConfig, rotary: RotaryCache
    ) -> None:
        if pool.layout.kv_parts != 1 or pool.layout.head_dim != mla.latent_dim:
            raise ValueError(f"an MLA backend needs a latent pool of {mla.latent_dim} per token, not {pool.layout}")
        super().__init__(pool, page_table, num_heads, mla.qk_head_dim, rotary)
        self.mla = mla
        self.scale = mla.softmax_scale

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        self._absorbed = self.absorbed_decode and self._segments is None and self._shape[1] == 1

    def forward_mla(self, layer: int, positions: torch.Tensor, parts: MlaParts, proj: MlaProjections) -> torch.Tensor:
        q_nope, q_pe, latent, k_pe = parts
        q_pe, k_pe = self.rotary.apply(positions, q_pe, k_pe.unsqueeze(1))
        entry = torch.cat((latent.unsqueeze(1), k_pe), dim=-1)  # [T, 1, latent_dim]
        offset = self.pool.layer_offset(layer, 0)
        store_rows(self.pool.rows, self._out_rows + offset, entry)
        if self._absorbed:
            q = torch.cat((proj.absorb_query(q_nope), q_pe), dim=-1)  # [T, H, latent_dim]
            kk = self._gather(offset, q.dtype)  # [B, max_kv, 1, latent_dim]: one key head for every query head
            out = self.attend_padded(q, kk, kk[..., : self.mla.kv_lora_rank], self.scale)
            return proj.values_from_latent(out)
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, qk_head_dim]
        if self._segments is None:
            b, _, max_kv = self._shape
            k, v = self._decompress(self._gather(offset, q.dtype).view(b * max_kv, -1), proj)
            return self.attend_padded(q, k.view(b, max_kv, *k.shape[1:]), v.view(b, max_kv, *v.shape[1:]), self.scale)
        out = q.new_empty(q.shape[0], q.shape[1], self.mla.v_head_dim)
        rows = self.pool.rows
        for seg in self._segments:
            if seg.kv_flat is None:  # no cached prefix: this step's entries, as the pool holds them
                entries = as_stored(entry[seg.q0 : seg.q1, 0], rows.dtype).to(q.dtype)
            else:
                entries = rows.index_select(0, seg.kv_flat + offset)[:, 0].to(q.dtype)
            k, v = self._decompress(entries, proj)
            o = F.scaled_dot_product_attention(
                q[seg.q0 : seg.q1].transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=seg.mask,
                is_causal=seg.mask is None,
                scale=self.scale,
            )
            out[seg.q0 : seg.q1] = o[0].transpose(0, 1)
        return out

    def _gather(self, offset: int, dtype: torch.dtype) -> torch.Tensor:
        """Every request's cached entries of the layer at `offset`, padded: `[B, max_kv, 1, latent_dim]`."""
        b, _, max_kv = self._shape
        rows = self.pool.rows.index_select(0, self._kv_flat + offset)
        return rows.view(b, max_kv, 1, -1).to(dtype)

    def _decompress(self, entries: torch.Tensor, proj: MlaProjections) -> tuple[torch.Tensor, torch.Tensor]:
        k_nope, v = proj.expand(entries[:, : self.mla.kv_lora_rank])
        k_pe = entries[:, None, self.mla.kv_lora_rank :].expand(-1, k_nope.shape[1], -1)
        return torch.cat((k_nope, k_pe), dim=-1), v
