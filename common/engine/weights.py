"""Weight loading: stream safetensors into the merged parameters of `DecoderModel`, or make dummy weights."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from common.engine.model import DecoderModel

log = logging.getLogger("kvferry.model")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _target(model: DecoderModel, name: str) -> tuple[torch.Tensor, slice | None] | None:
    """Maps an HF tensor name to (destination parameter, rows of it) or None when the model has no use for it."""
    cfg = model.cfg
    if name == "model.embed_tokens.weight":
        return model.embed, None
    if name == "model.norm.weight":
        return model.norm, None
    if name == "lm_head.weight":
        return (model.lm_head, None) if model.lm_head is not None else None
    m = _LAYER.match(name)
    if m is None:
        return None
    layer = model.layers[int(m.group(1))]
    rest = m.group(2)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    qkv_rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
    direct = {
        "input_layernorm.weight": layer.input_norm,
        "post_attention_layernorm.weight": layer.post_attn_norm,
        "self_attn.o_proj.weight": layer.o_proj,
        "mlp.down_proj.weight": layer.down_proj,
        "self_attn.q_norm.weight": layer.q_norm,
        "self_attn.k_norm.weight": layer.k_norm,
    }
    if rest in direct:
        dst = direct[rest]
        return (dst, None) if dst is not None else None
    proj, _, kind = rest.rpartition(".")
    short = proj.split(".")[-1]
    if short in qkv_rows:
        dst = layer.qkv_proj if kind == "weight" else layer.qkv_bias
        return (dst, qkv_rows[short]) if dst is not None else None
    if short == "gate_proj":
        return layer.gate_up_proj, slice(0, inter)
    if short == "up_proj":
        return layer.gate_up_proj, slice(inter, 2 * inter)
    return None


def load_safetensors_dir(model: DecoderModel, path: Path) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    expected = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    device = "cpu"
    for file in files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                target = _target(model, name)
                if target is None:
                    continue
                dst, rows = target
                tensor = f.get_tensor(name)
                view = dst.data if rows is None else dst.data[rows]
                if view.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(view.shape)}")
                view.copy_(tensor.to(dst.dtype))
                seen.add(id(dst))
    missing = expected - seen
    if missing:
        names = [n for n, p in model.named_parameters() if id(p) in missing]
        raise ValueError(f"checkpoint in {path} lacks weights for: {', '.join(names[:8])}")


def init_dummy_weights(model: DecoderModel, seed: int = 0) -> None:
    """Random weights (never zeros) with scales that keep activations finite through every layer."""
    # Generated on the parameter's device: an 8B model's worth of randn on the CPU takes minutes.
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        if "norm" in name:
            values = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            values = 0.02 * noise
        else:
            values = noise * (p.shape[-1] ** -0.5)
        p.data.copy_(values.to(p.dtype))
