"""DeepSeek's multi-head latent attention (MLA) on the paged pool: the layer's projections and the torch backend.

Per token and layer the cache holds one entry of `kv_lora_rank + qk_rope_head_dim` values (`MlaConfig.latent_dim`):
the normed latent `c` and the roped key part `k_pe` shared by every head. Each head's key is [W_UK_h c | k_pe] and
its value W_UV_h c, where `kv_b_proj` stacks [W_UK_h; W_UV_h] per head. Two ways to attend, equal in exact
arithmetic:
- decompressed (prefill): expand every cached latent through `kv_b_proj` into per-head keys and values, then plain
  attention with `qk_head_dim`-wide heads. Each key is expanded once per step, and a prefill step has about as many
  queries as keys, so this is the cheaper form there;
- absorbed (decode): fold W_UK_h into the query, q_h' = [W_UK_h^T q_nope_h | q_pe_h], and attend over the cached
  entries themselves as one key head shared by all heads, their first `kv_lora_rank` values being the values;
  W_UV_h then maps each head's output back. A decode step has one query per request against the whole context:
  expanding the context would cost `heads * (nope + v) * kv_lora_rank` per cached token and step, absorbing costs
  that once per query, and attention reads only the latent entries (what DeepSeek describes for inference).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.attention import TorchPagedAttention
from common.engine.forward_batch import ForwardBatch
from common.engine.fp8 import as_stored, store_rows
from common.engine.layers import KvWrite, Ops, RotaryCache
from common.engine.model_config import MlaConfig, ModelConfig
from common.kv.pool import KVPool


class MlaProjections(nn.Module):
    """One layer's MLA weights beside its merged input projection (`DecoderLayer.qkv_proj`: [q_a or q; kv_a], one
    GEMM of the normed hidden states) and `o_proj`: the query's low-rank norm and up-projection (`q_lora_rank` > 0),
    the latent's norm and `kv_b_proj` `[heads * (nope + v), kv_lora_rank]`."""

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
        """Rows of the merged input projection that make the query (q_a's, or q's without a low-rank step)."""
        return self.mla.q_lora_rank or self.num_heads * self.mla.qk_head_dim

    def split(
        self, qkv: torch.Tensor, ops: Ops, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The merged projection's output `[T, q_rows + latent_dim]` as (q_nope `[T, H, nope]`, q_pe `[T, H, rope]`,
        the normed latent `[T, kv_lora_rank]`, k_pe `[T, rope]`), RoPE not yet applied."""
        mla, t = self.mla, qkv.shape[0]
        q, latent, k_pe = qkv.split((self.q_rows, mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1)
        if self.q_b_proj is not None and self.q_a_norm is not None:
            q = F.linear(ops.rms_norm(q, self.q_a_norm, eps), self.q_b_proj)
        q_nope, q_pe = q.reshape(t, self.num_heads, mla.qk_head_dim).split(
            (mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1
        )
        return q_nope, q_pe, ops.rms_norm(latent, self.kv_a_norm, eps), k_pe

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK `[H, nope, kv_lora_rank]`, W_UV `[H, v, kv_lora_rank]`): views of `kv_b_proj`."""
        w = self.kv_b_proj.view(self.num_heads, -1, self.mla.kv_lora_rank)
        return w[:, : self.mla.qk_nope_head_dim], w[:, self.mla.qk_nope_head_dim :]

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents `[N, kv_lora_rank]` as each head's key part without RoPE `[N, H, nope]` and value
        `[N, H, v]` (the decompressed form)."""
        kv = F.linear(latent, self.kv_b_proj).view(latent.shape[0], self.num_heads, -1)
        return kv.split((self.mla.qk_nope_head_dim, self.mla.v_head_dim), dim=-1)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope `[T, H, nope]` in latent space, W_UK_h^T q_h: `[T, H, kv_lora_rank]` (the absorbed form)."""
        w_uk, _ = self._up()
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def values_from_latent(self, out: torch.Tensor) -> torch.Tensor:
        """Each head's attention output in latent space `[T, H, kv_lora_rank]` as its value output, W_UV_h o_h:
        `[T, H, v]` (the absorbed form's last step)."""
        _, w_uv = self._up()
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


class MlaBackend(Protocol):
    """What a decoder layer with latent attention needs from its attention backend."""

    def forward_mla(
        self,
        layer: int,
        positions: torch.Tensor,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        proj: MlaProjections,
    ) -> torch.Tensor:
        """RoPE on q_pe `[T, H, rope]` and k_pe `[T, rope]` at `positions`, this step's [latent | k_pe] stored at
        the step's slots, attention over each request's entries: `[T, H, v_head_dim]`."""
        ...


class TorchMlaAttention(TorchPagedAttention):
    """MLA over a latent pool (`KVLayout.kv_parts` 1, one `[1, latent_dim]` row per token and layer) in plain torch,
    with the paged layouts and step plan of `TorchPagedAttention`. Steps of one query per request (decode) attend
    in the absorbed form, others decompressed (`absorbed_decode` False: every step decompressed, which tests
    compare the absorbed form against)."""

    absorbed_decode = True

    def __init__(
        self, pool: KVPool, page_table: torch.Tensor, num_heads: int, mla: MlaConfig, rotary: RotaryCache
    ) -> None:
        if pool.layout.kv_parts != 1 or pool.layout.head_dim != mla.latent_dim:
            raise ValueError(f"an MLA backend needs a latent pool of {mla.latent_dim} per token, not {pool.layout}")
        super().__init__(pool, page_table, num_heads, mla.qk_head_dim, rotary)
        self.mla = mla
        self.scale = mla.softmax_scale

    def forward(
        self, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        raise TypeError("latent attention layers call forward_mla")

    def kv_write(self, layer: int, positions: torch.Tensor) -> KvWrite | None:
        return None  # the entry is [normed latent | roped k_pe]: not a qkv GEMM's output

    def plan(self, batch: ForwardBatch) -> None:
        super().plan(batch)
        self._absorbed = self.absorbed_decode and self._segments is None and self._shape[1] == 1

    def forward_mla(
        self,
        layer: int,
        positions: torch.Tensor,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        proj: MlaProjections,
    ) -> torch.Tensor:
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
        """Entries `[N, latent_dim]` as per-head keys `[N, H, qk_head_dim]` and values `[N, H, v]`."""
        k_nope, v = proj.expand(entries[:, : self.mla.kv_lora_rank])
        k_pe = entries[:, None, self.mla.kv_lora_rank :].expand(-1, k_nope.shape[1], -1)
        return torch.cat((k_nope, k_pe), dim=-1), v
