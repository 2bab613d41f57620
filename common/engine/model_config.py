"""A model's shape as read from its HuggingFace config.json: attention, rope, MLA and MoE, checked once."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3")
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", *MLA_ARCHITECTURES)
ROPE_KINDS = ("default", "linear", "llama3", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (1 when it is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # YaRN (DeepSeek's long-context checkpoints): the frequency ramp's bounds in rotations, and the magnitude
    # corrections: `mscale` / `mscale_all_dim` scale cos and sin (their ratio), `mscale_all_dim` the softmax too.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # a checkpoint's explicit cos/sin scale (YaRN), else derived

    @property
    def cos_sin_scale(self) -> float:
        """What YaRN multiplies cos and sin by (so q and k's rotated parts); 1 for the other kinds."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """DeepSeek's YaRN factor on the softmax scale, squared as its attention applies it (1: none)."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> RopeConfig:
        params = dict(cfg.get("rope_parameters") or {})
        params.update(cfg.get("rope_scaling") or {})
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ROPE_KINDS:
            raise ValueError(f"unsupported rope_type {kind!r}; supported: {', '.join(ROPE_KINDS)}")
        default_original = 8192 if kind != "yarn" else int(cfg.get("max_position_embeddings", 4096))
        factor = params.get("factor")
        original = int(params.get("original_max_position_embeddings") or default_original)
        if factor is None:  # YaRN without a factor: the context's stretch over the pretrained one
            factor = int(cfg.get("max_position_embeddings", original)) / original if kind == "yarn" else 1.0
        attention_factor = params.get("attention_factor")
        return cls(
            theta=float(theta),
            kind=kind,
            factor=float(factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            attention_factor=float(attention_factor) if attention_factor is not None else None,
        )


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention. Keys and values come from one latent per token: the hidden state
    projected to `kv_lora_rank` and RMS-normed, which `kv_b_proj` expands per head into a key part without RoPE
    (`qk_nope_head_dim`) and a value (`v_head_dim`); beside it one RoPE key part (`qk_rope_head_dim`) shared by
    every head. The cache keeps only [latent | roped key part] per token (`latent_dim`). Queries come from the
    hidden state directly (`q_lora_rank` 0: V2-Lite) or through a normed low-rank projection."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale squared where the rope says so
    rope_interleaved: bool  # the checkpoint's RoPE dims pair (0, 1), (2, 3), ...: reordered to halves at load

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Elements of one token's cache entry, per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], rope: RopeConfig) -> MlaConfig:
        model_type = cfg["model_type"]
        if cfg.get("attention_bias"):
            raise ValueError(f"{model_type}: MLA projections with biases are not supported")
        nope, rope_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
        return cls(
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(cfg["v_head_dim"]),
            softmax_scale=(nope + rope_dim) ** -0.5 * rope.softmax_mscale,
            # V2's checkpoints are always interleaved; V3 says so (transformers' default: True).
            rope_interleaved=model_type == "deepseek_v2" or bool(cfg.get("rope_interleave", True)),
        )


TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: `num_experts` routed experts, each a SiLU-gated MLP of `intermediate_size`, of
    which each token takes `top_k`; `layers`: the layers whose MLP is this one (the others keep the dense MLP of
    `ModelConfig.intermediate_size`).

    Gating (common/engine/moe.py: `route`): scores are the softmax of the router logits (`scoring` softmax) or
    each logit's sigmoid (DeepSeek-V3); `topk_method` greedy takes the top k scores, group_limited_greedy
    (DeepSeek-V2) only from the `topk_group` of `n_group` expert groups with the best single score, noaux_tc
    (DeepSeek-V3) from the groups with the best two-score sums, choosing by score + a learned per-expert
    `correction_bias` while weighting by the score alone. The chosen scores are renormalised to sum to 1 when
    `renormalize`, then multiplied by `routed_scaling_factor`. `shared_intermediate_size`: an always-on shared
    expert (DeepSeek: n_shared_experts of them, one MLP this wide), added unweighted."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    layers: tuple[int, ...]
    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    float32_router: bool = False  # DeepSeek computes router logits in float32 whatever the model's dtype

    @property
    def correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> MoeConfig:
        model_type = cfg["model_type"]
        if model_type in MLA_ARCHITECTURES:
            return cls._deepseek(cfg)
        # Qwen3-MoE's own configs say num_experts; transformers saves it under Mixtral's num_local_experts.
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok", 0))
        _check_experts(model_type, experts, top_k)
        layers = range(cfg["num_hidden_layers"])
        if model_type == "mixtral":  # every layer sparse, the top-k always renormalised
            return cls(experts, top_k, int(cfg["intermediate_size"]), True, tuple(layers))
        if cfg.get("shared_expert_intermediate_size"):
            raise ValueError(f"{model_type}: shared experts are not supported")
        dense = set(cfg.get("mlp_only_layers") or ())
        step = int(cfg.get("decoder_sparse_step", 1))
        sparse = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
        return cls(experts, top_k, int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", False)), sparse)

    @classmethod
    def _deepseek(cls, cfg: dict[str, Any]) -> MoeConfig:
        model_type = cfg["model_type"]
        v3 = model_type == "deepseek_v3"
        experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok") or 0)
        _check_experts(model_type, experts, top_k)
        scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if scoring not in ("softmax", "sigmoid") or method not in TOPK_METHODS or (v3 and method != "noaux_tc"):
            raise ValueError(f"{model_type}: gating {scoring} / {method} is not supported")
        groups, top_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        if method == "greedy":
            groups = top_groups = 1
        per_group = experts // groups
        if experts % groups or not 1 <= top_groups <= groups or top_k > top_groups * per_group:
            raise ValueError(
                f"{model_type}: {experts} experts in {groups} groups, top {top_groups} groups, {top_k} per token"
            )
        if method == "noaux_tc" and groups > 1 and per_group < 2:
            raise ValueError(f"{model_type}: noaux_tc ranks groups by their two best experts; groups of {per_group}")
        first, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
        sparse = tuple(i for i in range(cfg["num_hidden_layers"]) if i >= first and i % freq == 0)
        renormalize = bool(cfg.get("norm_topk_prob", False))
        scale = float(cfg.get("routed_scaling_factor") or 1.0)
        if not v3 and renormalize and top_k > 1:
            scale = 1.0  # V2's gate scales only the weights it does not renormalise
        return cls(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=int(cfg["moe_intermediate_size"]),
            renormalize=renormalize and top_k > 1,
            layers=sparse,
            scoring=scoring,
            topk_method=method,
            n_group=groups,
            topk_group=top_groups,
            routed_scaling_factor=scale,
            shared_intermediate_size=int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"]),
            float32_router=True,
        )


def _check_experts(model_type: str, experts: int, top_k: int) -> None:
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"{model_type}: {experts} experts with {top_k} per token is not a mixture of experts")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder-only families kvferry runs; they differ only in the flags below."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    moe: MoeConfig | None = None  # Qwen3-MoE, Mixtral, DeepSeek: the routed experts and the layers that have them
    # DeepSeek: latent attention. The cache then holds one "KV head" (num_kv_heads 1) of head_dim
    # `mla.latent_dim` per token and layer, and no separate V.
    mla: MlaConfig | None = None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates per head: every one, or MLA's RoPE part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        rope = RopeConfig.from_hf_dict(cfg)
        mla = MlaConfig.from_hf_dict(cfg, rope) if model_type in MLA_ARCHITECTURES else None
        if mla is not None:
            kv_heads, head_dim = 1, mla.latent_dim
        else:
            kv_heads, head_dim = (
                cfg.get("num_key_value_heads", heads),
                cfg.get("head_dim") or cfg["hidden_size"] // heads,
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")) and mla is None,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            eos_token_ids=eos_ids,
            name=name,
            moe=MoeConfig.from_hf_dict(cfg) if model_type in MOE_ARCHITECTURES else None,
            mla=mla,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        with open(path / "config.json") as f:
            return cls.from_hf_dict(json.load(f), name=path.name)
