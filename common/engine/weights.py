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


def _target(model: DecoderModel, name: str) -> tuple[torch.Tensor, slice | None, str] | None:
    """Maps an HF tensor name to (destination parameter, rows of it, projection kind for tensor-parallel
    slicing) or None when the model has no use for it. Row slices are in this rank's local sizes."""
    cfg = model.cfg
    if name == "model.embed_tokens.weight":
        return model.embed, None, "vocab"
    if name == "model.norm.weight":
        return model.norm, None, "none"
    if name == "lm_head.weight":
        return (model.lm_head, None, "vocab") if model.lm_head is not None else None
    m = _LAYER.match(name)
    if m is None:
        return None
    layer = model.layers[int(m.group(1))]
    rest = m.group(2)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    qkv_rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
    direct = {
        "input_layernorm.weight": (layer.input_norm, "none"),
        "post_attention_layernorm.weight": (layer.post_attn_norm, "none"),
        "self_attn.o_proj.weight": (layer.o_proj, "o"),
        "mlp.down_proj.weight": (layer.down_proj, "down"),
        "self_attn.q_norm.weight": (layer.q_norm, "none"),
        "self_attn.k_norm.weight": (layer.k_norm, "none"),
    }
    if rest in direct:
        dst, kind = direct[rest]
        return (dst, None, kind) if dst is not None else None
    proj, _, leaf = rest.rpartition(".")
    short = proj.split(".")[-1]
    if short in qkv_rows:
        dst = layer.qkv_proj if leaf == "weight" else layer.qkv_bias
        return (dst, qkv_rows[short], short[0]) if dst is not None else None
    if short == "gate_proj":
        return layer.gate_up_proj, slice(0, inter), "gate"
    if short == "up_proj":
        return layer.gate_up_proj, slice(inter, 2 * inter), "up"
    return None


def load_safetensors_dir(model: DecoderModel, path: Path) -> None:
    """Loads a checkpoint, keeping only this rank's slice of every tensor under tensor parallelism."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    expected = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    shard = model.tp.shard
    device = "cpu"
    for file in files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                target = _target(model, name)
                if target is None:
                    continue
                dst, rows, kind = target
                tensor = shard.hf_slice(kind, f.get_tensor(name), model.full_cfg)
                view = dst.data if rows is None else dst.data[rows]
                if view.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(view.shape)}")
                view.copy_(tensor.to(dst.dtype))
                seen.add(id(dst))
    missing = expected - seen
    if missing:
        names = [n for n, p in model.named_parameters() if id(p) in missing]
        raise ValueError(f"checkpoint in {path} lacks weights for: {', '.join(names[:8])}")


def _full_shape(model: DecoderModel, name: str, local: torch.Size) -> tuple[int, ...]:
    """The unsplit shape of a parameter, so every tensor-parallel rank draws the same full tensor."""
    full, leaf = model.full_cfg, name.rsplit(".", 1)[-1]
    qkv = full.q_size + 2 * full.kv_size
    shapes = {
        "embed": (full.vocab_size, full.hidden_size),
        "lm_head": (full.vocab_size, full.hidden_size),
        "qkv_proj": (qkv, full.hidden_size),
        "qkv_bias": (qkv,),
        "o_proj": (full.hidden_size, full.q_size),
        "gate_up_proj": (2 * full.intermediate_size, full.hidden_size),
        "down_proj": (full.hidden_size, full.intermediate_size),
    }
    return shapes.get(leaf, tuple(local))


def init_dummy_weights(model: DecoderModel, seed: int = 0) -> None:
    """Random weights (never zeros) with scales that keep activations finite through every layer.

    Each rank draws the full tensor and keeps its slice, so TP=N ranks together hold TP=1's weights.
    """
    # Generated on the parameter's device: an 8B model's worth of randn on the CPU takes minutes.
    gen = torch.Generator(device=model.device).manual_seed(seed)
    shard = model.tp.shard
    for name, p in model.named_parameters():
        full = torch.randn(_full_shape(model, name, p.shape), generator=gen, device=p.device, dtype=torch.float32)
        noise = shard.merged_slice(name, full, model.full_cfg)
        if "norm" in name:
            values = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            values = 0.02 * noise
        else:
            values = noise * (full.shape[-1] ** -0.5)
        p.data.copy_(values.to(p.dtype))
