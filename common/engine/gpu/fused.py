"""The decoder forward on the GPU path, with flashinfer's fused kernels.

Same weights and the same arithmetic as `DecoderModel.forward`, arranged for fewer passes over memory:
the residual stream is carried separately so each norm after the first is one fused add + RMSNorm kernel;
RoPE reads q/k straight out of the merged qkv projection and writes contiguous rotated copies (the
attention kernel's input); SiLU-and-mul is one kernel. Per layer: 4 GEMMs, 2 norms, 1 RoPE, 2 KV writes,
attention and the activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.engine.model import DecoderModel


def cos_sin_cache(model: DecoderModel) -> torch.Tensor:
    """flashinfer's RoPE table: [max_position, head_dim] float32, cos in the first half, sin in the second."""
    return torch.cat((model.rotary.cos, model.rotary.sin), dim=-1).float().contiguous()


def fused_forward(
    model: DecoderModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn,
    cos_sin: torch.Tensor,
    logits_indices: torch.Tensor | None = None,
    float_logits: bool = True,
) -> torch.Tensor:
    """One step over packed tokens; logits of `logits_indices` (all tokens when None)."""
    import flashinfer

    cfg = model.cfg
    eps = cfg.rms_norm_eps
    t = input_ids.shape[0]
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    split = (cfg.q_size, cfg.kv_size, cfg.kv_size)
    tp = model.tp
    hidden = tp.embed(input_ids, model.embed)
    residual: torch.Tensor | None = None
    for i, layer in enumerate(model.layers):
        if residual is None:
            residual = hidden
            x = flashinfer.rmsnorm(hidden, layer.input_norm, eps)
        else:
            flashinfer.fused_add_rmsnorm(hidden, residual, layer.input_norm, eps)
            x = hidden
        qkv = F.linear(x, layer.qkv_proj, layer.qkv_bias)
        q, k, v = qkv.split(split, dim=-1)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = flashinfer.rmsnorm(q.view(t, hq, d), layer.q_norm, eps)
            k = flashinfer.rmsnorm(k.view(t, hkv, d), layer.k_norm, eps)
            flashinfer.apply_rope_with_cos_sin_cache_inplace(positions, q.view(t, -1), k.view(t, -1), d, cos_sin, True)
        else:
            q, k = flashinfer.apply_rope_with_cos_sin_cache(positions, q, k, d, cos_sin, True)
        o = attn.forward(i, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d))
        hidden = tp.all_reduce(F.linear(o.view(t, cfg.q_size), layer.o_proj))
        flashinfer.fused_add_rmsnorm(hidden, residual, layer.post_attn_norm, eps)
        hidden = F.linear(flashinfer.silu_and_mul(F.linear(hidden, layer.gate_up_proj)), layer.down_proj)
        hidden = tp.all_reduce(hidden)
    assert residual is not None
    if logits_indices is not None and logits_indices.shape[0] == 0:  # a prefill step where no request samples
        return torch.empty(
            0, cfg.vocab_size, dtype=torch.float32 if float_logits else hidden.dtype, device=hidden.device
        )
    if logits_indices is not None:
        hidden = hidden[logits_indices]
        residual = residual[logits_indices]
    flashinfer.fused_add_rmsnorm(hidden, residual, model.norm, eps)
    logits = tp.gather_logits(F.linear(hidden, model.lm_head_weight), cfg.vocab_size)
    return logits.float() if float_logits else logits
