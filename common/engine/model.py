"""The decoder used for every supported family (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V2/V3):
they differ only in `ModelConfig` flags. Projections are merged (qkv, gate_up), and backends differ only in the
ops object and attention backend given to the one forward.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from common.engine.attention import AttentionBackend
from common.engine.forward_batch import ForwardBatch
from common.engine.fp8 import FP8, Fp8Linear, quantize_rows
from common.engine.layers import (
    Activated,
    InStream,
    Ops,
    RotaryCache,
    Rotated,
    TorchOps,
    onednn_linear_available,
    pack_linear_weight,
)
from common.engine.mla import MlaBackend, MlaProjections
from common.engine.model_config import ModelConfig
from common.engine.moe import MoeExperts
from common.engine.tp import TPGroup, single_rank


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


# A layer's GEMM weights: what FP8 weights quantize (embeddings, norms and the LM head keep the model dtype).
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ATTENTION_LINEARS = LINEARS[:2]  # a mixture-of-experts layer's (its experts are `moe`'s)


class DecoderLayer(nn.Module):
    """One layer's weights under this rank's local `cfg`. `moe`: a mixture-of-experts MLP; `fp8`: e4m3 GEMM
    weights with a float32 scale per output row; `cfg.mla`: latent attention (`mla` holds its extra projections)."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, fp8: bool = False, moe: bool = False
    ) -> None:
        super().__init__()
        self.linears = ATTENTION_LINEARS if moe else LINEARS
        h = cfg.hidden_size
        if fp8 and cfg.mla is not None:
            raise ValueError(f"{cfg.model_type}: latent attention runs 16/32-bit weights (FP8 ones are dequantized)")
        self.mla = MlaProjections(cfg, dtype, device) if cfg.mla is not None else None
        qkv = cfg.q_size + 2 * cfg.kv_size if self.mla is None else self.mla.q_rows + self.mla.mla.latent_dim
        o_in = cfg.q_size if cfg.mla is None else cfg.num_heads * cfg.mla.v_head_dim
        wt = FP8 if fp8 else dtype
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.qkv_proj = _param(qkv, h, dtype=wt, device=device)
        self.qkv_bias = _param(qkv, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.q_norm = _param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.o_proj = _param(h, o_in, dtype=wt, device=device)
        self.post_attn_norm = _param(h, dtype=dtype, device=device)
        self.moe = MoeExperts(cfg.moe, h, dtype, device) if moe and cfg.moe is not None else None
        self.gate_up_proj = None if moe else _param(2 * cfg.intermediate_size, h, dtype=wt, device=device)
        self.down_proj = None if moe else _param(h, cfg.intermediate_size, dtype=wt, device=device)
        if fp8:
            for name in self.linears:
                rows = getattr(self, name).shape[0]
                setattr(self, f"{name}_scale", _param(rows, dtype=torch.float32, device=device))
        # The GEMM weights as the ops run them: oneDNN-packed (CPU float32) or FP8 with scales; empty: plain.
        self.packed: dict[str, torch.Tensor | Fp8Linear] = {}
        self.fp8 = fp8
        if fp8:
            self.use_fp8_forms()

    def use_fp8_forms(self) -> None:
        self.packed = {n: Fp8Linear(getattr(self, n), getattr(self, f"{n}_scale")) for n in self.linears}

    def quantize_linears(self) -> None:
        """Replaces the GEMM weights by FP8 ones, one scale per output channel."""
        for name in self.linears:
            weight, scale = quantize_rows(getattr(self, name).data)
            setattr(self, name, nn.Parameter(weight, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale.flatten(), requires_grad=False))
        self.fp8 = True
        self.use_fp8_forms()

    def dequantize_linears(self, dtype: torch.dtype) -> None:
        """FP8 GEMM weights back to `dtype`, for a device without FP8 kernels."""
        for name in self.linears:
            w = Fp8Linear(getattr(self, name), getattr(self, f"{name}_scale")).dequantize(dtype)
            setattr(self, name, nn.Parameter(w, requires_grad=False))
            delattr(self, f"{name}_scale")
        self.fp8 = False
        self.packed = {}


class DecoderModel(nn.Module):
    """The whole decoder, or one tensor-parallel rank's part of it (`cfg`: this rank's; `full_cfg`: the
    checkpoint's). `ops` runs norms, activation and GEMMs; attention is the backend passed to each step."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
        fp8_weights: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp if tp is not None else single_rank(cfg)
        self.full_cfg = cfg
        self.cfg = cfg = self.tp.shard.local_config(cfg)
        self.dtype = dtype
        self.device = device
        vocab_rows = self.tp.shard.vocab_per_rank
        self.embed = _param(vocab_rows, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, device, fp8_weights, cfg.is_moe_layer(i)) for i in range(cfg.num_layers)
        )
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            None if cfg.tie_word_embeddings else _param(vocab_rows, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.rotary = RotaryCache.build(cfg.rope_dim, cfg.rope, cfg.max_position, device)
        self.ops: Ops = TorchOps()
        # FP8 KV: each layer's static K, V scale from the checkpoint; empty: 1.0.
        self.kv_scales: tuple[float, ...] = ()
        self.packed_lm_head: torch.Tensor | None = None

    def pack_linears(self) -> bool:
        """CPU float32: keeps oneDNN-packed copies of every GEMM weight (faster than `F.linear` at every token
        count) and uses them from now on; call again after changing weights. Returns whether it packed."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or not onednn_linear_available():
            return False
        for layer in self.layers:
            if not layer.fp8:  # FP8 weights keep their FP8 form
                layer.packed = {n: pack_linear_weight(getattr(layer, n)) for n in layer.linears}
        self.packed_lm_head = pack_linear_weight(self.lm_head_weight)
        return True

    def unpack_linears(self) -> None:
        for layer in self.layers:
            if layer.fp8:
                layer.use_fp8_forms()
            else:
                layer.packed = {}
        self.packed_lm_head = None

    @property
    def fp8_weights(self) -> bool:
        return bool(self.layers) and self.layers[0].fp8

    def quantize_linears(self) -> None:
        """FP8 weights from this model's, one layer at a time (packed CPU copies are dropped)."""
        for layer in self.layers:
            if not layer.fp8:
                layer.quantize_linears()

    def dequantize_linears(self) -> None:
        for layer in self.layers:
            if layer.fp8:
                layer.dequantize_linears(self.dtype)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Runs one planned step; returns float32 logits of the tokens at `batch.logits_indices` only."""
        every_token = batch.is_decode and batch.logits_indices.shape[0] == batch.num_tokens
        indices = None if every_token else batch.logits_indices
        return self.forward_tokens(batch.input_ids, batch.positions, attn, indices)

    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        logits_indices: torch.Tensor | None = None,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """The decoder over `T` packed tokens (CUDA graphs capture this call); logits at `logits_indices` (None:
        every token), float32 unless `float_logits` is False."""
        hidden, residual = self.forward_hidden(input_ids, positions, attn)
        return self.final_logits(hidden, residual, logits_indices, float_logits)

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> tuple[torch.Tensor | InStream, torch.Tensor]:
        """Every layer over `T` packed tokens: the last output (or `InStream`) and the residual stream, before
        the final norm (piecewise graphs break this call at each layer's attention)."""
        cfg, ops, tp = self.cfg, self.ops, self.tp
        eps = cfg.rms_norm_eps
        hidden = tp.embed(input_ids, self.embed)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            pk = layer.packed
            hidden, residual = self._attention(i, layer, hidden, residual, positions, attn)
            if layer.moe is not None:
                normed, residual = ops.norm(hidden, residual, layer.post_attn_norm, eps)
                hidden = tp.all_reduce(layer.moe(normed))  # partial sums under TP, as a dense down_proj's
                continue
            gate_up, residual = ops.norm_linear(
                hidden,
                residual,
                layer.post_attn_norm,
                eps,
                layer.gate_up_proj,
                None,
                pk.get("gate_up_proj"),
                gated=True,
            )
            hidden, residual = self._project(gate_up, layer.down_proj, residual, pk.get("down_proj"), silu=True)
        assert residual is not None
        return hidden, residual

    def _attention(
        self,
        i: int,
        layer: DecoderLayer,
        hidden: torch.Tensor | InStream,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor | InStream, torch.Tensor]:
        """Layer `i`'s input norm, attention (grouped-query or latent) and output projection into the stream."""
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        t = positions.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pk = layer.packed
        # The qkv GEMM may rotate q and k and store K/V itself, unless q/k norms sit between them (a latent
        # backend's entry is no GEMM's output: its `kv_write` is None).
        write = attn.kv_write(i, positions) if layer.q_norm is None else None
        qkv, residual = ops.norm_linear(
            hidden,
            residual,
            layer.input_norm,
            eps,
            layer.qkv_proj,
            layer.qkv_bias,
            pk.get("qkv_proj"),
            False,
            write,
        )
        if layer.mla is not None:
            assert isinstance(qkv, torch.Tensor)
            o = cast(MlaBackend, attn).forward_mla(i, positions, layer.mla.split(qkv, ops, eps), layer.mla)
        elif isinstance(qkv, Rotated):
            o = attn.attend(i, qkv.q)
        else:
            q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
            q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = ops.rms_norm(q, layer.q_norm, eps), ops.rms_norm(k, layer.k_norm, eps)
            o = attn.forward(i, positions, q, k, v)
        return self._project(o.reshape(t, -1), layer.o_proj, residual, pk.get("o_proj"))

    def _project(
        self,
        x: torch.Tensor | Activated,
        weight: torch.Tensor,
        residual: torch.Tensor,
        packed: torch.Tensor | Fp8Linear | None,
        silu: bool = False,
    ) -> tuple[torch.Tensor | InStream, torch.Tensor]:
        if self.tp.size == 1:
            return self.ops.project(x, weight, residual, packed, silu)
        out = self.ops.silu_linear(x, weight, packed) if silu else self.ops.linear(x, weight, None, packed)
        return self.tp.all_reduce(out), residual

    def final_logits(
        self,
        hidden: torch.Tensor | InStream,
        residual: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
        float_logits: bool = True,
    ) -> torch.Tensor:
        """The final norm and LM head over the rows at `logits_indices` (None: every row)."""
        cfg, ops, tp = self.cfg, self.ops, self.tp
        eps = cfg.rms_norm_eps
        dtype = torch.float32 if float_logits else residual.dtype
        if logits_indices is not None:
            if logits_indices.shape[0] == 0:  # a prefill step where no request samples (every rank skips alike)
                return torch.empty(0, cfg.vocab_size, dtype=dtype, device=residual.device)
            hidden = hidden.rows(logits_indices) if isinstance(hidden, InStream) else hidden[logits_indices]
            residual = residual[logits_indices]
        logits, _ = ops.norm_linear(hidden, residual, self.norm, eps, self.lm_head_weight, None, self.packed_lm_head)
        return tp.gather_logits(logits, cfg.vocab_size).to(dtype)
