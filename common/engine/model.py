"""The decoder used for every supported family (Llama, Mistral, Qwen2, Qwen3).

The families differ only in flags on `ModelConfig` (q/k/v bias, q/k RMSNorm, tied embeddings, RoPE
scaling), so one file serves them all. Projections are merged (qkv, gate_up) so a layer is four GEMMs.
"""

from __future__ import annotations

import torch
from torch import nn

from common.engine.attention import AttentionBackend
from common.engine.forward_batch import ForwardBatch
from common.engine.layers import (
    RotaryCache,
    linear,
    onednn_linear_available,
    pack_linear_weight,
    rms_norm,
    silu_and_mul,
)
from common.engine.model_config import ModelConfig
from common.engine.tp import TPGroup, single_rank


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """One layer; `cfg` is this rank's local config (its heads and MLP slice under tensor parallelism)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        h = cfg.hidden_size
        qkv = cfg.q_size + 2 * cfg.kv_size
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.qkv_proj = _param(qkv, h, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.q_norm = _param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.o_proj = _param(h, cfg.q_size, dtype=dtype, device=device)
        self.post_attn_norm = _param(h, dtype=dtype, device=device)
        self.gate_up_proj = _param(2 * cfg.intermediate_size, h, dtype=dtype, device=device)
        self.down_proj = _param(h, cfg.intermediate_size, dtype=dtype, device=device)
        self.packed: dict[str, torch.Tensor] = {}  # CPU: oneDNN-packed copies of the GEMM weights (pack_linears)

    def forward(
        self,
        layer_id: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryCache,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        x = rms_norm(hidden, self.input_norm, eps)
        pk = self.packed
        qkv = linear(x, self.qkv_proj, self.qkv_bias, pk.get("qkv_proj"))
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        t = hidden.shape[0]
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, eps)
            k = rms_norm(k, self.k_norm, eps)
        q = rotary.apply(q, positions)
        k = rotary.apply(k, positions)
        o = attn.forward(layer_id, q, k, v).reshape(t, cfg.q_size)
        hidden = hidden + self.tp.all_reduce(linear(o, self.o_proj, None, pk.get("o_proj")))
        x = rms_norm(hidden, self.post_attn_norm, eps)
        act = silu_and_mul(linear(x, self.gate_up_proj, None, pk.get("gate_up_proj")))
        return hidden + self.tp.all_reduce(linear(act, self.down_proj, None, pk.get("down_proj")))


class DecoderModel(nn.Module):
    """The whole decoder, or one tensor-parallel rank's part of it (`tp`; see common/engine/tp.py).

    `full_cfg` is the checkpoint's config; `cfg` is this rank's (its heads and MLP slice; the full vocabulary).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None else single_rank(cfg)
        self.full_cfg = cfg
        self.cfg = cfg = self.tp.shard.local_config(cfg)
        self.dtype = dtype
        self.device = device
        vocab_rows = self.tp.shard.vocab_per_rank
        self.embed = _param(vocab_rows, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, self.tp) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            None if cfg.tie_word_embeddings else _param(vocab_rows, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.rotary = RotaryCache.build(cfg.head_dim, cfg.rope, cfg.max_position, device)
        self.packed_lm_head: torch.Tensor | None = None

    def pack_linears(self) -> bool:
        """CPU float32: keeps oneDNN-packed copies of every GEMM weight and uses them from now on.

        On the CPUs measured (AMD EPYC, 2 threads) oneDNN with packed weights runs these GEMMs 2-2.4x faster than
        `F.linear` (MKL sgemm) at every token count, decode and prefill alike. The copies are snapshots: call
        again after changing weights (or `unpack_linears`). Returns whether weights were packed.
        """
        if self.device.type != "cpu" or self.dtype != torch.float32 or not onednn_linear_available():
            return False
        for layer in self.layers:
            names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
            layer.packed = {n: pack_linear_weight(getattr(layer, n)) for n in names}
        self.packed_lm_head = pack_linear_weight(self.lm_head_weight)
        return True

    def unpack_linears(self) -> None:
        for layer in self.layers:
            layer.packed = {}
        self.packed_lm_head = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Runs one step; returns float32 logits of the tokens at `batch.logits_indices` only."""
        hidden = self.tp.embed(batch.input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            hidden = layer(i, hidden, batch.positions, self.rotary, attn)
        last = hidden[batch.logits_indices]
        last = rms_norm(last, self.norm, self.cfg.rms_norm_eps)
        logits = linear(last, self.lm_head_weight, None, self.packed_lm_head)
        return self.tp.gather_logits(logits, self.cfg.vocab_size).float()
