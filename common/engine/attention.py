"""Attention backends: plan once per step, run per layer; a backend owns RoPE, the K/V write and the attention
(torch here for the CPU; flashinfer on the GPU)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from common.engine.forward_batch import ForwardBatch
from common.engine.fp8 import as_stored, store_rows
from common.engine.layers import KvWrite, RotaryCache
from common.kv.pool import KVPool


class AttentionBackend(Protocol):
    def plan(self, batch: ForwardBatch) -> None: ...

    def forward(
        self, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D], not yet rotated -> [T, Hq, D] (RoPE, K/V write and attention fused)."""
        ...

    def kv_write(self, layer: int, positions: torch.Tensor) -> KvWrite | None:
        """Where this step's K/V go for a qkv GEMM that rotates and stores them itself; None: `forward` needed."""
        ...

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of the rotated q after the qkv GEMM wrote this step's K/V as `kv_write` said."""
        ...


class _Segment:
    __slots__ = ("q0", "q1", "kv_flat", "mask")

    def __init__(self, q0: int, q1: int, kv_flat: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        self.q0, self.q1 = q0, q1
        self.kv_flat = kv_flat  # pool slots of all its keys; None: no cached prefix, its keys are this step's k/v
        self.mask = mask  # [1, 1, n, S] causal mask with a cached prefix; None: plain causal (is_causal)


class TorchPagedAttention:
    """Paged attention in plain torch on `scaled_dot_product_attention`, indices and masks planned once per step:
    a padded batch (`index_select` gathers: 2-D advanced indexing is several times slower on CPU) under one mask,
    or, where padding would waste much of the work, one causal call per request."""

    # Prefill layout: "auto" (by estimated cost), "padded" or "segments" (tests and benchmarks force one).
    prefill_layout = "auto"
    # Fixed cost of one SDPA call, in (query, key) pairs of attention work; calibrated on CPU.
    _CALL_COST_PAIRS = 1024

    def __init__(
        self, pool: KVPool, page_table: torch.Tensor, num_heads: int, head_dim: int, rotary: RotaryCache
    ) -> None:
        self.pool = pool
        self.rotary = rotary
        self.page_table = page_table
        self.num_heads = num_heads
        self.scale = head_dim**-0.5
        self._batch: ForwardBatch | None = None
        self._segments: list[_Segment] | None = None

    def _use_segments(self, seq: list[int], ext: list[int]) -> bool:
        if max(ext) == 1 or self.prefill_layout == "padded":
            return False  # decode steps always run padded: one query per request, no causal work to skip
        if self.prefill_layout == "segments":
            return True
        padded = len(seq) * max(ext) * max(seq)
        # Causal calls skip about half of each request's (query, key) rectangle.
        per_request = sum(n * s for n, s in zip(ext, seq)) // 2 + len(seq) * self._CALL_COST_PAIRS
        return per_request < padded

    def plan(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        b = batch.batch_size
        seq, ext = batch.seq_lens_cpu, batch.extend_lens_cpu
        max_kv, max_q = max(seq), max(ext)
        self._shape = (b, max_q, max_kv)
        self._batch = batch
        self._segments = None
        self._out_rows = self.pool.token_rows(batch.out_loc)  # pool rows of layer 0's K; + layer_offset per layer
        if self._use_segments(seq, ext):
            self._plan_segments(batch)
            return
        kv_pos = torch.arange(max_kv, device=device)
        rows = self.page_table[:, :max_kv].index_select(0, batch.table_rows).to(torch.int64)  # [B, max_kv]
        kv_valid = kv_pos[None, :] < batch.seq_lens[:, None]
        self._kv_flat = self.pool.token_rows(torch.where(kv_valid, rows, torch.zeros_like(rows)).flatten())
        self._q_padded = max_q > 1
        if max_q == 1:
            # Decode: one query per request, at its last position, which sees every valid key.
            self._mask = kv_valid[:, None, None, :] if min(seq) < max_kv else None
            return
        q_pos = torch.arange(max_q, device=device)
        q_valid = q_pos[None, :] < batch.extend_lens[:, None]  # [B, max_q]
        # Query j of request i sits at absolute position seq_len - extend_len + j and sees keys <= that.
        q_abs = (batch.seq_lens - batch.extend_lens)[:, None] + q_pos[None, :]
        mask = (kv_pos[None, None, :] <= q_abs[:, :, None]) & kv_valid[:, None, :]
        mask &= q_valid[:, :, None]
        # Padded query rows would see no key (NaN softmax): they see key 0 and are discarded.
        mask[:, :, 0] |= ~q_valid
        self._mask = mask[:, None, :, :]  # [B, 1, max_q, max_kv]
        if self._q_padded:
            q_index = torch.where(q_valid, batch.q_start[:, None] + q_pos[None, :], torch.zeros_like(q_pos))
            self._q_gather = q_index.flatten()  # [B * max_q] packed token of each padded query row
            # Valid padded rows in row-major order are exactly the packed order (q_start is a cumsum).
            self._q_scatter = q_valid.flatten().nonzero().flatten()  # [T]

    def _plan_segments(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        segments = []
        q0 = 0
        for i, (s, n) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
            kv_flat = mask = None
            if s > n:  # a cached prefix (chunked prefill, prefix-cache hit): gather it, bottom-right causal mask
                kv_flat = self.pool.token_rows(self.page_table[batch.table_rows[i], :s].to(torch.int64))
                q_abs = torch.arange(s - n, s, device=device)
                mask = (torch.arange(s, device=device)[None, :] <= q_abs[:, None])[None, None]
            segments.append(_Segment(q0, q0 + n, kv_flat, mask))
            q0 += n
        self._segments = segments

    def forward(
        self, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        batch = self._batch
        assert batch is not None, "plan() must run before forward()"
        q, k = self.rotary.apply(positions, q, k)
        rows = self.pool.rows
        ko, vo = self.pool.layer_offset(layer, 0), self.pool.layer_offset(layer, 1)
        ks, vs = self.pool.layout.kv_scale(layer, 0), self.pool.layout.kv_scale(layer, 1)
        store_rows(rows, self._out_rows + ko, k, ks)
        store_rows(rows, self._out_rows + vo, v, vs)
        if self._segments is not None:
            return self._forward_segments(q, k, v, ko, vo, ks, vs)
        return self.attend(layer, q)

    def kv_write(self, layer: int, positions: torch.Tensor) -> KvWrite | None:
        if self._segments is not None:
            return None  # a step run per request attends to this step's k/v as computed, not as stored
        layout = self.pool.layout
        return KvWrite(
            positions,
            self.rotary.cos_sin(),
            self.pool.rows,
            self._out_rows,
            self.pool.layer_offset(layer, 0),
            self.pool.layer_offset(layer, 1),
            layout.kv_scale(layer, 0),
            layout.kv_scale(layer, 1),
        )

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The padded layout over the pool; FP8 scales fold into the softmax scale and output, as in flashinfer."""
        assert self._segments is None, "a step run per request attends in forward()"
        b, _, max_kv = self._shape
        rows = self.pool.rows
        hkv, d = rows.shape[1], rows.shape[2]
        ko, vo = self.pool.layer_offset(layer, 0), self.pool.layer_offset(layer, 1)
        ks, vs = self.pool.layout.kv_scale(layer, 0), self.pool.layout.kv_scale(layer, 1)
        kk = rows.index_select(0, self._kv_flat + ko).view(b, max_kv, hkv, d)
        vv = rows.index_select(0, self._kv_flat + vo).view(b, max_kv, hkv, d)
        out = self.attend_padded(q, kk.to(q.dtype), vv.to(q.dtype), self.scale * ks)
        return out * vs if vs != 1.0 else out

    def attend_padded(self, q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the packed queries over each request's gathered keys and values (Hk divides Hq; Dv may
        differ from D) in the padded layout `plan` set up: `[T, Hq, Dv]`."""
        b, max_q, max_kv = self._shape
        t, hq, d = q.shape
        if self._q_padded:
            qq = q.index_select(0, self._q_gather).view(b, max_q, hq, d)
        else:
            qq = q.view(b, max_q, hq, d)  # decode: max_q == 1, T == B
        out = F.scaled_dot_product_attention(
            qq.transpose(1, 2),
            kk.transpose(1, 2),
            vv.transpose(1, 2),
            attn_mask=self._mask,
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)  # [B, max_q, Hq, Dv]
        if self._q_padded:
            return out.reshape(b * max_q, hq, -1).index_select(0, self._q_scatter)
        return out.reshape(t, hq, -1)

    def _forward_segments(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ko: int, vo: int, ks: float, vs: float
    ) -> torch.Tensor:
        assert self._segments is not None
        rows = self.pool.rows
        out = torch.empty_like(q)
        for seg in self._segments:
            qq = q[seg.q0 : seg.q1].transpose(0, 1)[None]  # [1, Hq, n, D]
            if seg.kv_flat is None:
                # Round-trip through the pool dtype: the values later steps read from the pool.
                kk = as_stored(k[seg.q0 : seg.q1], rows.dtype, ks).transpose(0, 1)[None]
                vv = as_stored(v[seg.q0 : seg.q1], rows.dtype, vs).transpose(0, 1)[None]
            else:
                kk = rows.index_select(0, seg.kv_flat + ko).transpose(0, 1)[None]
                vv = rows.index_select(0, seg.kv_flat + vo).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qq,
                kk.to(q.dtype),
                vv.to(q.dtype),
                attn_mask=seg.mask,
                is_causal=seg.mask is None,
                scale=self.scale * ks,
                enable_gqa=True,
            )
            out[seg.q0 : seg.q1] = (o[0] * vs if vs != 1.0 else o[0]).transpose(0, 1)
        return out
