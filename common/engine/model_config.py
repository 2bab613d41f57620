from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: softmax over `num_experts` router logits, the `top_k` best kept (their weights
    renormalised to sum to 1 when `renormalize`), each a SiLU-gated MLP of `intermediate_size`. `layers`: the
    layers whose MLP is this one; the others keep the dense MLP of `ModelConfig.intermediate_size`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    layers: tuple[int, ...]

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> MoeConfig:
        model_type = cfg["model_type"]
        # Qwen3-MoE's own configs say num_experts; transformers saves it under Mixtral's num_local_experts.
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok", 0))
        if experts < 1 or not 1 <= top_k <= experts:
            raise ValueError(f"{model_type}: {experts} experts with {top_k} per token is not a mixture of experts")
        layers = range(cfg["num_hidden_layers"])
        if model_type == "mixtral":  # every layer sparse, the top-k always renormalised
            return cls(experts, top_k, int(cfg["intermediate_size"]), True, tuple(layers))
        if cfg.get("shared_expert_intermediate_size"):
            raise ValueError(f"{model_type}: shared experts are not supported")
        dense = set(cfg.get("mlp_only_layers") or ())
        step = int(cfg.get("decoder_sparse_step", 1))
        sparse = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
        return cls(experts, top_k, int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", False)), sparse)


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
    moe: MoeConfig | None = None  # Qwen3-MoE, Mixtral: the routed experts and the layers that have them

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

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
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_params.update(cfg.get("rope_scaling") or {})
        theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rope_params.get("rope_type", rope_params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {kind!r}")
        rope = RopeConfig(
            theta=float(theta),
            kind=kind,
            factor=float(rope_params.get("factor", 1.0)),
            low_freq_factor=float(rope_params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope_params.get("high_freq_factor", 4.0)),
            original_max_position=int(rope_params.get("original_max_position_embeddings", 8192)),
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
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            eos_token_ids=eos_ids,
            name=name,
            moe=MoeConfig.from_hf_dict(cfg) if model_type in MOE_ARCHITECTURES else None,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        with open(path / "config.json") as f:
            return cls.from_hf_dict(json.load(f), name=path.name)


# Named configs for benchmarks with dummy weights (no download needed); shapes from the published configs.
NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        eos_token_id=[128001, 128008, 128009],
        rope_parameters=dict(
            rope_theta=500000.0,
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        eos_token_id=151645,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        eos_token_id=151645,
    ),
    # The MoE target: 48 layers of 128 experts (8 per token, renormalised), 3B of its 30B active.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        eos_token_id=151645,
    ),
    # A token-sized decoder for measuring the host's share of a step (bench/host_step.py): a forward of
    # microseconds, so what remains of a step is scheduling, batch building and metadata.
    "host-probe": dict(
        model_type="llama",
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        eos_token_id=1023,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        eos_token_id=2,
    ),
}


def named_config(name: str) -> ModelConfig:
    if name not in NAMED_CONFIGS:
        raise KeyError(f"unknown named config {name!r}; known: {', '.join(NAMED_CONFIGS)}")
    return ModelConfig.from_hf_dict(NAMED_CONFIGS[name], name=name)
