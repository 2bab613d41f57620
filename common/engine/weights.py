"""Weight loading: stream safetensors into the merged parameters of `DecoderModel`, or make dummy weights."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from common.engine.fp8 import is_fp8
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
    if leaf not in ("weight", "bias", "weight_scale"):
        return None  # an FP8 checkpoint's static activation scales (input_scale): activations scale per token
    if leaf == "weight_scale":  # FP8 checkpoints: the scales of a GEMM weight, per tensor or per output row
        if not layer.fp8:
            raise ValueError(f"{name}: an FP8 checkpoint's scale, but the model was built without FP8 weights")
        merged = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
        merged |= {"up_proj": "gate_up_proj", "o_proj": "o_proj", "down_proj": "down_proj"}
        if short not in merged:
            return None
        rows = qkv_rows.get(short) or {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}.get(short)
        kind = {"gate_proj": "gate", "up_proj": "up", "o_proj": "o", "down_proj": "down"}.get(short, short[0])
        return getattr(layer, f"{merged[short]}_scale"), rows, kind
    if short in qkv_rows:
        dst = layer.qkv_proj if leaf == "weight" else layer.qkv_bias
        return (dst, qkv_rows[short], short[0]) if dst is not None else None
    if short == "gate_proj":
        return layer.gate_up_proj, slice(0, inter), "gate"
    if short == "up_proj":
        return layer.gate_up_proj, slice(inter, 2 * inter), "up"
    return None


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What a compressed-tensors FP8 checkpoint's `quantization_config` declares (as published for the
    Llama / Qwen FP8 models): e4m3 weights of every Linear but the ignored ones (the LM head), their
    `weight_scale` per tensor (`strategy: tensor`, one scalar) or per output channel (`channel`, `[out, 1]`);
    `kv_cache` when it also ships static `k_scale` / `v_scale` for an FP8 KV cache. Activation scales it may
    declare (static `input_scale`, or dynamic per token) are not read: activations are always scaled per
    token at each GEMM."""

    weight_strategy: str  # "tensor" | "channel"
    kv_cache: bool


def fp8_checkpoint(path: Path) -> Fp8Checkpoint | None:
    """The FP8 format of the checkpoint in `path` (None: not quantized); raises for a quantization this engine
    does not load (another method, integer or 4-bit weights, per-group scales)."""
    with open(path / "config.json") as f:
        qc = json.load(f).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"{path}: quantization {method!r} is not supported (FP8 compressed-tensors is)")
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if not weights or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
        raise ValueError(f"{path}: only FP8 (8-bit float) compressed-tensors weights are supported, not {weights}")
    strategies = {w.get("strategy", "tensor") for w in weights}
    if not strategies <= {"tensor", "channel"} or len(strategies) != 1:
        raise ValueError(f"{path}: FP8 weight scales per tensor or per channel are supported, not {strategies}")
    return Fp8Checkpoint(weight_strategy=strategies.pop(), kv_cache=bool(qc.get("kv_cache_scheme")))


_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")


def load_safetensors_dir(model: DecoderModel, path: Path) -> None:
    """Loads a checkpoint, keeping only this rank's slice of every tensor under tensor parallelism.

    An FP8 model (`DecoderModel(fp8_weights=True)`, for a compressed-tensors checkpoint) takes the e4m3
    weights as they are and their `weight_scale`s as one scale per output row (a per-tensor scale repeated
    over the tensor's rows: q, k and v keep their own in the merged qkv); static KV scales go to
    `model.kv_scales`."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    expected = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    shard = model.tp.shard
    device = "cpu"
    kv_scales = [1.0] * (2 * model.cfg.num_layers)
    for file in files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                kv = _KV_SCALE.match(name)
                if kv is not None:
                    which = kv.group(2) or kv.group(3)
                    kv_scales[2 * int(kv.group(1)) + (which == "v")] = float(f.get_tensor(name).float().max())
                    continue
                target = _target(model, name)
                if target is None:
                    continue
                dst, rows, kind = target
                tensor = f.get_tensor(name)
                if name.endswith(".weight_scale"):
                    view = dst.data if rows is None else dst.data[rows]
                    if tensor.numel() == 1:  # per tensor: every output row of it
                        dst_rows = view.shape[0]
                        tensor = tensor.reshape(1).expand(dst_rows).contiguous()
                    else:  # per channel, [out, 1]: sliced by rows like the weight (o / down: all of them)
                        tensor = shard.hf_slice(
                            kind if kind not in ("o", "down") else "none", tensor.flatten(), model.full_cfg
                        )
                else:
                    tensor = shard.hf_slice(kind, tensor, model.full_cfg)
                view = dst.data if rows is None else dst.data[rows]
                if view.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(view.shape)}")
                if is_fp8(dst.dtype) and not is_fp8(tensor.dtype) and not name.endswith(".weight_scale"):
                    raise ValueError(f"{name}: {tensor.dtype} in a checkpoint whose other GEMM weights are FP8")
                view.copy_(tensor.to(dst.dtype))
                seen.add(id(dst))
    if any(sc != 1.0 for sc in kv_scales):
        model.kv_scales = tuple(kv_scales)
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
