"""Model shapes by name, for benchmarks and tests with dummy weights (no download needed); the shapes are
those of the published configs."""

from __future__ import annotations

from typing import Any

from common.engine.model_config import ModelConfig

__all__ = ["NAMED_CONFIGS", "named_config"]

# What every Qwen3 checkpoint shares: tokenizer, head size, norm epsilon, context and RoPE base.
_QWEN3: dict[str, Any] = dict(
    vocab_size=151936,
    head_dim=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    eos_token_id=151645,
)

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
        _QWEN3,
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen3-0.6b": dict(
        _QWEN3,
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    # The MoE target: 48 layers of 128 experts (8 per token, renormalised), 3B of its 30B active.
    "qwen3-30b-a3b": dict(
        _QWEN3,
        model_type="qwen3_moe",
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
        tie_word_embeddings=False,
    ),
    # The MLA target (16B, 2.4B active): 27 layers, the first dense, then 64 routed experts (6 per
    # token, softmax weights kept as they are) and 2 shared ones; queries without a low-rank step; a 512 + 64
    # latent cache entry per token and layer; YaRN stretching 4k to 160k, its mscale on the softmax.
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        scoring_func="softmax",
        first_k_dense_replace=1,
        moe_layer_freq=1,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        tie_word_embeddings=False,
        bos_token_id=100000,
        eos_token_id=100001,
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
