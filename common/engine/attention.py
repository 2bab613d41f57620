"""Attention backends: plan once per step, run per layer.

A backend owns the KV write (store this step's K/V into the pool at `out_loc`) and the attention over
each request's cached + new tokens. The torch backend below serves the CPU; the flashinfer backend
(GPU) implements the same two calls with its paged prefill/decode wrappers.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from common.engine.forward_batch import ForwardBatch
from common.kv.pool import KVPool


class AttentionBackend(Protocol):
    def plan(self, batch: ForwardBatch) -> None: ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]."""
        ...


class TorchPagedAttention:
    """Paged attention in plain torch: gather each request's KV slots into a padded batch, one SDPA call.

    The gather indices, padding and causal masks are built once per step in `plan`; per layer the work
    is one index_copy (store), two gathers and one scaled_dot_product_attention.
    """

    def __init__(self, pool: KVPool, page_table: torch.Tensor, num_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.page_table = page_table
        self.num_heads = num_heads
        self.scale = head_dim**-0.5
        self._batch: ForwardBatch | None = None

    def plan(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        b = batch.batch_size
        max_kv = max(batch.seq_lens_cpu)
        max_q = max(batch.extend_lens_cpu)
        kv_pos = torch.arange(max_kv, device=device)
        rows = self.page_table[batch.table_rows, :max_kv].to(torch.int64)  # [B, max_kv]
        kv_valid = kv_pos[None, :] < batch.seq_lens[:, None]
        self._kv_locs = torch.where(kv_valid, rows, torch.zeros_like(rows))
        q_pos = torch.arange(max_q, device=device)
        q_valid = q_pos[None, :] < batch.extend_lens[:, None]  # [B, max_q]
        # Query j of request i sits at absolute position seq_len - extend_len + j and sees keys <= that.
        q_abs = (batch.seq_lens - batch.extend_lens)[:, None] + q_pos[None, :]
        mask = (kv_pos[None, None, :] <= q_abs[:, :, None]) & kv_valid[:, None, :]
        mask &= q_valid[:, :, None]
        # Padded query rows would see no key at all (NaN softmax): let them see key 0; they are discarded.
        mask[:, :, 0] |= ~q_valid
        self._mask = mask[:, None, :, :]  # [B, 1, max_q, max_kv]
        self._q_index = torch.where(
            q_valid, batch.q_start[:, None] + q_pos[None, :], torch.zeros_like(q_valid, dtype=torch.int64)
        )
        self._q_valid = q_valid
        self._flat_q = self._q_index[q_valid]  # [T] in packed order
        self._shape = (b, max_q, max_kv)
        self._batch = batch

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch = self._batch
        assert batch is not None, "plan() must run before forward()"
        k_slots = self.pool.k_slots(layer)
        v_slots = self.pool.v_slots(layer)
        k_slots.index_copy_(0, batch.out_loc, k.to(k_slots.dtype))
        v_slots.index_copy_(0, batch.out_loc, v.to(v_slots.dtype))
        kk = k_slots[self._kv_locs].transpose(1, 2)  # [B, Hkv, max_kv, D]
        vv = v_slots[self._kv_locs].transpose(1, 2)
        qq = q[self._q_index].transpose(1, 2)  # [B, Hq, max_q, D]
        out = F.scaled_dot_product_attention(
            qq, kk.to(q.dtype), vv.to(q.dtype), attn_mask=self._mask, scale=self.scale, enable_gqa=True
        )
        out = out.transpose(1, 2)  # [B, max_q, Hq, D]
        packed = torch.empty_like(q)
        packed[self._flat_q] = out[self._q_valid]
        return packed
