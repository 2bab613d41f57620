"""Weight loading: stream safetensors into the merged parameters of `DecoderModel`, or make dummy weights."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from common.engine.fp8 import is_fp8, quantize_rows
from common.engine.model import DecoderLayer, DecoderModel
from common.engine.model_config import MlaConfig
from common.engine.moe import MoeExperts

log = logging.getLogger("kvferry.model")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# A routed expert's projection as Qwen3-MoE (gate_proj) and Mixtral (w1 gate, w3 up, w2 down) name them.
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_SHARED = re.compile(r"^mlp\.shared_experts\.(gate|up|down)_proj\.weight$")
# Where a destination's rows are: all of it (None), a row range, or (an expert, a row range of it).
Rows = slice | int | tuple[int, slice] | None


def _target(model: DecoderModel, name: str) -> tuple[torch.Tensor, Rows, str] | None:
    """An HF tensor name's (destination, rows in this rank's local sizes, kind for tensor-parallel slicing); None:
    unused."""
    cfg = model.cfg
    if name == "model.embed_tokens.weight":
        return model.embed, None, "vocab"
    if name == "model.norm.weight":
        return model.norm, None, "none"
    if name == "lm_head.weight":
        return (model.lm_head, None, "vocab") if model.lm_head is not None else None
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) >= len(model.layers):  # DeepSeek-V3's multi-token-prediction layer: unused
        return None
    layer = model.layers[int(m.group(1))]
    rest = m.group(2)
    if layer.moe is not None and rest.startswith(("mlp.", "block_sparse_moe.")):
        return _moe_target(layer.moe, rest)
    if layer.mla is not None and rest.startswith("self_attn."):
        return _mla_target(layer, rest.removeprefix("self_attn."))
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


def _mla_target(layer: DecoderLayer, rest: str) -> tuple[torch.Tensor, Rows, str] | None:
    """A latent-attention layer's tensors (DeepSeek's names): q_a / q and kv_a into `qkv_proj`, the rest into
    `MlaProjections`; kinds `mla_q` / `mla_kv_a` may need their RoPE rows reordered."""
    mla = layer.mla
    assert mla is not None
    q = mla.q_rows
    targets: dict[str, tuple[torch.Tensor | None, Rows, str]] = {
        "q_proj.weight": (layer.qkv_proj, slice(0, q), "mla_q"),
        "q_a_proj.weight": (layer.qkv_proj, slice(0, q), "none"),
        "kv_a_proj_with_mqa.weight": (layer.qkv_proj, slice(q, q + mla.mla.latent_dim), "mla_kv_a"),
        "q_a_layernorm.weight": (mla.q_a_norm, None, "none"),
        "q_b_proj.weight": (mla.q_b_proj, None, "mla_q"),
        "kv_a_layernorm.weight": (mla.kv_a_norm, None, "none"),
        "kv_b_proj.weight": (mla.kv_b_proj, None, "none"),
        "o_proj.weight": (layer.o_proj, None, "none"),
    }
    dst, rows, kind = targets.get(rest, (None, None, "none"))
    return (dst, rows, kind) if dst is not None else None


def mla_rope_rows(kind: str, tensor: torch.Tensor, mla: MlaConfig) -> torch.Tensor:
    """An interleaved checkpoint's RoPE rows reordered into halves (evens, then odds), as `RotaryCache` rotates:
    keys and queries permuted alike, so every attention score is unchanged."""
    if not mla.rope_interleaved or kind not in ("mla_q", "mla_kv_a"):
        return tensor
    r = mla.qk_rope_head_dim
    order = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))
    if kind == "mla_kv_a":
        return torch.cat((tensor[: mla.kv_lora_rank], tensor[mla.kv_lora_rank :][order]))
    heads = tensor.view(-1, mla.qk_head_dim, *tensor.shape[1:])
    rope = heads[:, mla.qk_nope_head_dim :][:, order]
    return torch.cat((heads[:, : mla.qk_nope_head_dim], rope), dim=1).reshape(tensor.shape)


def _moe_target(moe: MoeExperts, rest: str) -> tuple[torch.Tensor, Rows, str] | None:
    """A mixture-of-experts layer's MLP tensors: the router (and its bias), experts into the stacked `w13` and
    `w2`, and DeepSeek's shared expert."""
    if rest in ("mlp.gate.weight", "block_sparse_moe.gate.weight"):
        return moe.gate, None, "none"
    if rest == "mlp.gate.e_score_correction_bias":
        return (moe.correction_bias, None, "none") if moe.correction_bias is not None else None
    shared = _SHARED.match(rest)
    if shared is not None:
        if moe.shared_w13 is None or moe.shared_w2 is None:
            return None
        kind, width = shared.group(1), moe.shared_w2.shape[1]
        if kind == "down":
            return moe.shared_w2, None, "none"
        return moe.shared_w13, slice(0, width) if kind == "gate" else slice(width, 2 * width), "none"
    m = _EXPERT.match(rest)
    if m is None:
        return None
    e, kind = int(m.group(1)), _EXPERT_KIND[m.group(2)]
    inter = moe.w2.shape[2]  # this rank's slice of the expert's intermediate dim
    if kind == "down":
        return moe.w2, e, "expert_down"
    rows = slice(0, inter) if kind == "gate" else slice(inter, 2 * inter)
    return moe.w13, (e, rows), f"expert_{kind}"


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What an FP8 checkpoint's `quantization_config` declares: compressed-tensors (per-tensor or per-channel
    `weight_scale`, optional static KV scales) or `quant_method: fp8` (128 x 128 block scales, taken to one scale
    per output row at load). Activation scales are not read: activations are scaled per token at each GEMM."""

    weight_strategy: str  # "tensor" | "channel" | "block"
    kv_cache: bool
    block: tuple[int, int] | None = None  # (rows, columns) of a scale block: the "block" strategy


def fp8_checkpoint(path: Path) -> Fp8Checkpoint | None:
    """The FP8 format of the checkpoint in `path` (None: not quantized); raises for one this engine cannot load."""
    with open(path / "config.json") as f:
        qc = json.load(f).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"{path}: FP8 weights in {qc.get('fmt')!r} are not supported (e4m3 is)")
        block = qc.get("weight_block_size")
        if block is None:
            return Fp8Checkpoint(weight_strategy="tensor", kv_cache=False)
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"{path}: weight_block_size {block} is not [rows, columns]")
        return Fp8Checkpoint(weight_strategy="block", kv_cache=False, block=(int(block[0]), int(block[1])))
    if method != "compressed-tensors":
        raise ValueError(f"{path}: quantization {method!r} is not supported (FP8: compressed-tensors or fp8)")
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if not weights or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
        raise ValueError(f"{path}: only FP8 (8-bit float) compressed-tensors weights are supported, not {weights}")
    strategies = {w.get("strategy", "tensor") for w in weights}
    if not strategies <= {"tensor", "channel"} or len(strategies) != 1:
        raise ValueError(f"{path}: FP8 weight scales per tensor or per channel are supported, not {strategies}")
    return Fp8Checkpoint(weight_strategy=strategies.pop(), kv_cache=bool(qc.get("kv_cache_scheme")))


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-scaled e4m3 weight `[N, K]` (DeepSeek-V3's format: W = weight * its block's scale_inv) in float32."""
    n, k = weight.shape
    rows, cols = block
    s = scale_inv.float().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    if s.shape != (n, k):
        raise ValueError(f"block scales {tuple(scale_inv.shape)} do not cover a {n} x {k} weight in {block} blocks")
    return weight.float() * s


def rows_from_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scaled e4m3 weight as e4m3 with one scale per output row (dequantized, quantized again per row)."""
    return quantize_rows(dequantize_blocks(weight, scale_inv, block))


_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")


def load_safetensors_dir(model: DecoderModel, path: Path, block: tuple[int, int] | None = None) -> None:
    """Loads a checkpoint, keeping only this rank's slice of every tensor under tensor parallelism. FP8 weights
    keep one scale per output row; block-scaled ones are converted to that (`rows_from_blocks`), or dequantized
    into a model without an FP8 GEMM path. Static KV scales go to `model.kv_scales`."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    expected = {id(p) for p in model.parameters()}
    seen: set[object] = set()
    kv_scales = [1.0] * (2 * model.cfg.num_layers)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # block-scaled weights waiting for their other half
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                kv = _KV_SCALE.match(name)
                if kv is not None:
                    which = kv.group(2) or kv.group(3)
                    kv_scales[2 * int(kv.group(1)) + (which == "v")] = float(f.get_tensor(name).float().max())
                    continue
                prefix, _, leaf = name.rpartition(".")
                if block is not None and leaf in ("weight", "weight_scale_inv"):
                    target = _target(model, prefix + ".weight")
                    if target is None:
                        continue
                    tensor = f.get_tensor(name)
                    if leaf == "weight" and not is_fp8(tensor.dtype):  # a 16-bit one (norms, embeddings, LM head)
                        _put(model, target, name, tensor, seen)
                        continue
                    halves = pending.setdefault(prefix, {})
                    halves[leaf] = tensor
                    if len(halves) == 2:
                        del pending[prefix]
                        if not model.fp8_weights:  # a 16/32-bit model (latent attention, experts): dequantized
                            w = dequantize_blocks(halves["weight"], halves["weight_scale_inv"], block)
                            _put(model, target, prefix + ".weight", w, seen)
                            continue
                        wq, ws = rows_from_blocks(halves["weight"], halves["weight_scale_inv"], block)
                        _put(model, target, prefix + ".weight", wq, seen)
                        scale = prefix + ".weight_scale"
                        scale_target = _target(model, scale)
                        assert scale_target is not None  # the weight's own scale rows
                        _put(model, scale_target, scale, ws, seen)
                    continue
                target = _target(model, name)
                if target is not None:
                    _put(model, target, name, f.get_tensor(name), seen)
    if pending:
        raise ValueError(
            f"checkpoint in {path}: block-scaled weights or scales without the other: {sorted(pending)[:4]}"
        )
    if any(sc != 1.0 for sc in kv_scales):
        model.kv_scales = tuple(kv_scales)
    missing = expected - seen
    if missing:
        names = [n for n, p in model.named_parameters() if id(p) in missing]
        raise ValueError(f"checkpoint in {path} lacks weights for: {', '.join(names[:8])}")
    lacking = _missing_experts(model, seen)
    if lacking:
        raise ValueError(f"checkpoint in {path} lacks expert weights: {', '.join(lacking[:8])}")


def _missing_experts(model: DecoderModel, seen: set[object]) -> list[str]:
    """Stacked experts are filled piece by piece: every expert's gate, up and down must have come."""
    out = []
    for i, layer in enumerate(model.layers):
        if layer.moe is None:
            continue
        for e in range(layer.moe.w13.shape[0]):
            pieces = ((layer.moe.w13, "expert_gate"), (layer.moe.w13, "expert_up"), (layer.moe.w2, "expert_down"))
            out += [f"layer {i} expert {e} {kind[7:]}" for dst, kind in pieces if (id(dst), e, kind) not in seen]
    return out


def _put(
    model: DecoderModel, target: tuple[torch.Tensor, Rows, str], name: str, tensor: torch.Tensor, seen: set[object]
) -> None:
    dst, rows, kind = target
    shard = model.tp.shard
    view = dst.data if rows is None else dst.data[rows]
    if name.endswith(".weight_scale"):
        if tensor.numel() == 1:  # per tensor: every output row of it
            tensor = tensor.reshape(1).expand(view.shape[0]).contiguous()
        else:  # per channel, [out, 1]: sliced by rows like the weight (o / down: all of them)
            tensor = shard.hf_slice(kind if kind not in ("o", "down") else "none", tensor.flatten(), model.full_cfg)
    else:
        if model.cfg.mla is not None:
            tensor = mla_rope_rows(kind, tensor, model.cfg.mla)
        tensor = shard.hf_slice(kind, tensor, model.full_cfg)
    if view.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(view.shape)}")
    if is_fp8(dst.dtype) and not is_fp8(tensor.dtype) and not name.endswith(".weight_scale"):
        raise ValueError(f"{name}: {tensor.dtype} in a checkpoint whose other GEMM weights are FP8")
    view.copy_(tensor.to(dst.dtype))
    seen.add(id(dst))
    if kind.startswith("expert_"):  # one expert's piece of a stacked tensor (`_missing_experts`)
        seen.add((id(dst), rows if isinstance(rows, int) else rows[0], kind))  # type: ignore[index]


def _full_shape(model: DecoderModel, name: str, local: torch.Size) -> tuple[int, ...]:
    """The unsplit shape of a parameter, so every tensor-parallel rank draws the same full tensor."""
    full, leaf = model.full_cfg, name.rsplit(".", 1)[-1]
    if full.mla is not None:
        return tuple(local)  # one rank only (`TPShard.plan`): every local shape is the full one
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
    if full.moe is not None:
        e, i = full.moe.num_experts, full.moe.intermediate_size
        shapes |= {"w13": (e, 2 * i, full.hidden_size), "w2": (e, full.hidden_size, i)}
    return shapes.get(leaf, tuple(local))


def init_dummy_weights(model: DecoderModel, seed: int = 0) -> None:
    """Random weights with scales that keep activations finite; each rank draws the full tensor and keeps its
    slice, so TP=N ranks together hold TP=1's weights."""
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
