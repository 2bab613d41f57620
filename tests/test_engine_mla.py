"""DeepSeek-V2 / V3 (latent attention, DeepSeek's gating, shared experts) on random tiny checkpoints, exact against
transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM: teacher-forced logits, greedy tokens and logprobs
through the engine (chunked prefill, prefix-cache hits, the host tier), the absorbed decode form against the
decompressed one, the latent pool's bytes per token, block-scaled FP8 checkpoints, the configurations refused,
and one checkpoint served through the router, a prefill worker, NIXL and a decode worker."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from common.engine.fp8 import FP8, FP8_MAX
from common.engine.kv_sizing import model_kv_layout
from common.engine.model_config import ModelConfig
from common.engine.moe import route
from common.engine.named_configs import named_config
from common.engine.runner import ModelRunner, RunnerConfig
from common.engine.tp import TPShard
from common.kv.pool import KVPool
from common.offline import Engine
from common.protocol import SamplingParams, replace
from common.settings import SchedulerConfig
from common.transfer.layout import LayoutMismatch, check_compatible, layout_info
from tests.engine_helpers import assert_pool_clean, fresh_engine, hf_greedy
from tests.test_engine_random_models import VOCAB, _build_hf, _hf_greedy_with_margin, _random_prompts

NEW_TOKENS = 16

_MLA = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,  # transformers repeats MLA's per-head keys by heads // kv_heads: one each
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,  # layer 0 dense, 1 and 2 sparse
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    head_dim=16,  # transformers sizes RoPE by head_dim: MLA's RoPE part
    v_head_dim=24,
    tie_word_embeddings=False,
)
# YaRN with its original context well below the prompts' lengths, so the ramp and both mscales matter.
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=64)

CONFIGS = {
    # V3: low-rank queries, sigmoid scores with the correction bias, top-2 of 4 groups, renormalised, scaled.
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            _MLA,
            q_lora_rank=48,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=dict(_YARN, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8),
        ),
    ),
    # V2-Lite's shape: queries straight from the hidden states, greedy softmax top-k as it comes, YaRN 0.707.
    "deepseek-v2-lite": (
        "DeepseekV2Config",
        dict(
            _MLA,
            q_lora_rank=None,
            topk_method="greedy",
            norm_topk_prob=False,
            rope_parameters=dict(_YARN, mscale=0.707, mscale_all_dim=0.707),
        ),
    ),
    # V2's: the experts of the best 2 of 4 groups only (group_limited_greedy), weights scaled.
    "deepseek-v2-grouped": (
        "DeepseekV2Config",
        dict(
            _MLA,
            q_lora_rank=40,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
}


def _check_greedy(hf, prompts: list[list[int]], results) -> None:
    for i, (prompt, res) in enumerate(zip(prompts, results)):
        ref, margin = _hf_greedy_with_margin(hf, prompt, NEW_TOKENS)
        assert margin > 1e-4, f"prompt {i}: greedy near-tie in the reference (gap {margin:.2e})"
        assert res.finish_reason == "length"
        assert res.output_ids == ref, f"prompt {i} (len {len(prompt)}) diverges"


def _build_deepseek(name: str, seed: int = 1234):
    """transformers' model of a config above, its correction bias (a buffer, zeros at init) drawn at random."""
    hf = _build_hf(*CONFIGS[name], seed=seed)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for buf_name, buf in hf.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    return hf


@pytest.fixture(scope="module", params=list(CONFIGS))
def deepseek(request, tmp_path_factory):
    """(name, transformers model, checkpoint directory, our runner over it); one per config per module."""
    name = request.param
    hf = _build_deepseek(name)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path, safe_serialization=True)
    runner = ModelRunner(RunnerConfig(model=str(path), num_pages=128, max_running=8, max_seq_len=512))
    mc = runner.model_config
    assert mc.mla is not None and mc.moe is not None
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert list(mc.moe.layers) == sparse == [1, 2]
    return name, hf, path, runner


def test_teacher_forced_logits_match_transformers(deepseek) -> None:
    _, hf, _, runner = deepseek
    engine = fresh_engine(runner)
    for ids in _random_prompts(7, [1, 9, 150]):  # past YaRN's original context (64) and several pages
        ours = engine.score(ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert float(ref.std()) > 1.0, "logits too flat to tell models apart"
        torch.testing.assert_close(ours, ref, atol=5e-4, rtol=1e-4)
    assert_pool_clean(engine)


def test_greedy_concurrent_chunked_batch_matches_transformers(deepseek) -> None:
    _, hf, _, runner = deepseek
    prompts = _random_prompts(11, [5, 77, 130, 3])
    engine = fresh_engine(runner, max_prefill_tokens=32)  # the long prompts take several chunks
    results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    _check_greedy(hf, prompts, results)
    assert_pool_clean(engine)


def test_logprobs_match_transformers(deepseek) -> None:
    _, hf, _, runner = deepseek
    engine = fresh_engine(runner, max_prefill_tokens=32)
    prompts = _random_prompts(31, [9, 70])
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True)
    for prompt, res in zip(prompts, engine.generate(prompts, sp)):
        with torch.inference_mode():
            logp = hf(torch.tensor([prompt + res.output_ids])).logits[0].float().log_softmax(-1)
        rows = logp[len(prompt) - 1 : -1]
        assert res.output_ids == rows.argmax(-1).tolist()
        ref = rows.gather(1, torch.tensor(res.output_ids).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in res.logprobs]), ref, atol=1e-4, rtol=1e-4)
    assert_pool_clean(engine)


def test_shared_prefix_hits_the_latent_cache_and_stays_exact(deepseek) -> None:
    _, hf, _, runner = deepseek
    prefix = _random_prompts(21, [53])[0]
    prompts = [prefix + s for s in _random_prompts(22, [4, 30])]
    engine = fresh_engine(runner, max_prefill_tokens=48)
    sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    first = engine.generate(prompts[:1], sp)[0]
    rest = engine.generate(prompts[1:], sp)
    page = runner.cfg.page_size
    assert first.cached_tokens == 0
    assert all(r.cached_tokens >= len(prefix) // page * page > 0 for r in rest), [r.cached_tokens for r in rest]
    _check_greedy(hf, prompts, [first, *rest])
    assert_pool_clean(engine)


def test_absorbed_decode_equals_decompressed(deepseek) -> None:
    """Decode steps attend over the cached latents with W_UK folded into the query; the same steps run with every
    latent expanded into per-head keys and values give the same tokens and logprobs."""
    _, _, _, runner = deepseek
    prompts = _random_prompts(41, [12, 60, 33])
    sp = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=True)
    out = {}
    try:
        for absorbed in (True, False):
            runner.attn.absorbed_decode = absorbed  # type: ignore[attr-defined]
            engine = fresh_engine(runner, prefix_cache=False)
            out[absorbed] = engine.generate(prompts, sp)
            assert_pool_clean(engine)
    finally:
        runner.attn.absorbed_decode = True  # type: ignore[attr-defined]
    for a, d in zip(out[True], out[False]):
        assert a.output_ids == d.output_ids
        lp_a = torch.tensor([lp.logprob for lp in a.logprobs])
        lp_d = torch.tensor([lp.logprob for lp in d.logprobs])
        torch.testing.assert_close(lp_a, lp_d, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    """(transformers model, its saved checkpoint's directory) of the random DeepSeek-V3 config."""
    hf = _build_deepseek("deepseek-v3")
    path = tmp_path_factory.mktemp("deepseek-v3-checkpoint")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def test_prefixes_come_back_from_the_host_tier(v3_checkpoint) -> None:
    """A device pool too small for the documents: their latent pages go to the host tier and come back for the
    second round's questions, which then compute only their suffix and answer as transformers does."""
    hf, path = v3_checkpoint
    small = ModelRunner(RunnerConfig(model=str(path), num_pages=16, max_running=2, max_seq_len=512))
    gb = 40 * small.pool.page_stride_bytes / (1 << 30)
    sched = SchedulerConfig(max_prefill_tokens=64, enable_prefix_cache=True, host_kv_gb=gb)
    engine = Engine(runner=small, sched_cfg=sched, load_tokenizer=False)
    page = small.cfg.page_size
    docs = _random_prompts(51, [5 * page] * 4)  # 20 pages of documents against 16 in the pool
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for i, doc in enumerate(docs):
        engine.generate([doc + _random_prompts(52 + i, [7])[0]], sp)
    second = [doc + _random_prompts(60 + i, [9])[0] for i, doc in enumerate(docs)]
    results = [engine.generate([p], sp)[0] for p in second]
    assert engine.scheduler.cache.host is not None and engine.scheduler.cache.host.loaded_pages > 0
    assert all(r.cached_tokens >= 5 * page for r in results), [r.cached_tokens for r in results]
    for prompt, res in zip(second, results):
        assert res.output_ids == hf_greedy(hf, prompt, 4)
    assert_pool_clean(engine)


# ---- gating, layouts, checkpoints, refusals -------------------------------------------------------------------


def test_gating_equals_transformers_routers() -> None:
    """DeepSeek-V3's sigmoid + correction bias + grouped top-k and V2's group-limited softmax top-k, on random
    logits, against transformers' router modules (the same weights and hidden states)."""
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 128, generator=gen)
    for name, router_cls in (("deepseek-v3", DeepseekV3TopkRouter), ("deepseek-v2-grouped", DeepseekV2TopkRouter)):
        config_cls, extra = CONFIGS[name]
        hf_cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, hidden_size=128, num_attention_heads=4, **extra)
        router = router_cls(hf_cfg)
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=gen))
        _, ref_w, ref_ids = router(x)
        moe = ModelConfig.from_hf_dict(hf_cfg.to_dict()).moe
        assert moe is not None
        bias = getattr(router, "e_score_correction_bias", None)
        weights, ids = route(x @ router.weight.t(), moe, bias)
        order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
        assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order)), name
        torch.testing.assert_close(weights.gather(1, order), ref_w.gather(1, ref_order))


def test_configs_read_from_hf_fields() -> None:
    lite = named_config("deepseek-v2-lite")
    assert lite.mla is not None and lite.moe is not None
    assert (lite.mla.q_lora_rank, lite.mla.kv_lora_rank, lite.mla.latent_dim, lite.mla.v_head_dim) == (0, 512, 576, 128)
    assert (lite.num_kv_heads, lite.head_dim, lite.rope_dim) == (1, 576, 64)
    assert lite.moe.layers == tuple(range(1, 27)) and lite.moe.shared_intermediate_size == 2816
    assert (lite.moe.num_experts, lite.moe.top_k, lite.moe.scoring, lite.moe.renormalize) == (64, 6, "softmax", False)
    # YaRN x40: DeepSeek's softmax scale is 192^-0.5 times mscale(40, 0.707) squared; cos/sin stay unscaled.
    assert lite.rope.kind == "yarn" and lite.rope.cos_sin_scale == 1.0
    assert lite.mla.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 0.707 * torch.tensor(40.0).log().item() + 1) ** 2)
    # moe_layer_freq (DeepSeek's field, 1 in every release) thins the sparse layers after first_k_dense_replace.
    base = dict(CONFIGS["deepseek-v2-lite"][1], model_type="deepseek_v2", vocab_size=10, hidden_size=8)
    base |= dict(intermediate_size=16, num_attention_heads=2, num_hidden_layers=6)
    moe = ModelConfig.from_hf_dict({**base, "moe_layer_freq": 2}).moe
    assert moe is not None and moe.layers == (2, 4)
    # V2 scales only the weights it does not renormalise; V3 scales after renormalising.
    v2 = ModelConfig.from_hf_dict({**base, "norm_topk_prob": True, "routed_scaling_factor": 16.0}).moe
    assert v2 is not None and v2.renormalize and v2.routed_scaling_factor == 1.0
    with pytest.raises(ValueError, match="gating"):
        ModelConfig.from_hf_dict({**base, "model_type": "deepseek_v3", "topk_method": "greedy"})
    with pytest.raises(ValueError, match="groups"):
        ModelConfig.from_hf_dict({**base, "topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1})


def test_latent_pool_bytes_per_token_against_gqa() -> None:
    """One [latent | RoPE key] entry per token and layer: DeepSeek-V2-Lite keeps 27 x 576 values per token, where
    the GQA models of similar size keep K and V of every KV head (bf16 pools; the numbers go to the docs)."""
    layouts = {
        name: model_kv_layout(named_config(name), 16, torch.bfloat16) for name in NAMED_GQA + ("deepseek-v2-lite",)
    }
    per_token = {name: layout.bytes_per_token for name, layout in layouts.items()}
    print("KV bytes per token (bf16):", json.dumps(per_token))
    assert per_token == {
        "deepseek-v2-lite": 27 * 576 * 2,
        "llama-3.1-8b": 32 * 2 * 8 * 128 * 2,
        "qwen3-30b-a3b": 48 * 2 * 4 * 128 * 2,
    }
    pool = KVPool(layouts["deepseek-v2-lite"], 4)
    assert pool.page_stride_bytes == per_token["deepseek-v2-lite"] * 16  # one page: every layer's entries, one block
    assert pool.rows.shape[1:] == (1, 576)
    with pytest.raises(ValueError, match="no separate V"):
        pool.v_cache(0)


NAMED_GQA = ("llama-3.1-8b", "qwen3-30b-a3b")


def test_transfer_layouts_tell_latent_from_gqa_pools() -> None:
    """The handshake's layout carries the entry count per token: a latent pool and a K/V pool never exchange pages."""
    lite = KVPool(model_kv_layout(named_config("deepseek-v2-lite"), 16, torch.bfloat16), 2)
    info = layout_info(lite, "m")
    assert (info.kv_parts, info.num_kv_heads, info.head_dim) == (1, 1, 576)
    check_compatible(info, layout_info(lite, "m"))
    gqa = replace(info, kv_parts=2)
    with pytest.raises(LayoutMismatch, match="kv_parts"):
        check_compatible(info, gqa)


def _block_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` as DeepSeek-V3 ships weights: e4m3 values and one float32 `weight_scale_inv` per block x block tile."""
    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:n, :k] = w
    tiles = padded.view(rows, block, cols, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [rows, cols]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows * block, cols * block)[:n, :k].contiguous(), scale


def test_block_scaled_fp8_checkpoint_loads_dequantized(tmp_path) -> None:
    """Every projection of a V3 checkpoint (attention and experts; not the router, norms, embeddings or LM head) as
    e4m3 with 128 x 128 block scales and `quantization_config` as DeepSeek-V3's: the engine's logits equal
    transformers' over the dequantized weights."""
    import transformers

    hf = _build_deepseek("deepseek-v3", seed=99)
    hf.save_pretrained(tmp_path / "source", safe_serialization=True)
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    (shard,) = (tmp_path / "source").glob("*.safetensors")
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    quantized, dequantized = {}, {}
    for key, w in load_file(shard).items():
        if w.dim() == 2 and key.endswith(("proj.weight", "proj_with_mqa.weight")):
            q, s = _block_quantize(w.float(), 128)
            quantized[key], quantized[key + "_scale_inv"] = q, s
            dequantized[key] = (
                q.float() * s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
            )
        else:
            quantized[key] = dequantized[key] = w
    assert any(k.startswith("model.layers.2.mlp.experts.") and k.endswith("_scale_inv") for k in quantized)
    block_config = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])
    for directory, tensors, cfg in (
        (fp8_dir, quantized, config | {"quantization_config": block_config}),
        (ref_dir, dequantized, config),
    ):
        directory.mkdir()
        save_file(tensors, directory / shard.name, metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(cfg))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    runner = ModelRunner(RunnerConfig(model=str(fp8_dir), num_pages=32, max_running=2, max_seq_len=256))
    assert runner.model.layers[2].moe.w13.dtype == torch.float32
    ids = _random_prompts(3, [90])[0]
    with torch.inference_mode():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(fresh_engine(runner).score(ids), ref, atol=5e-4, rtol=1e-4)
    # A scale without its weight is refused, naming the tensor.
    del quantized["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(quantized, fp8_dir / shard.name, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="experts.3.up_proj"):
        ModelRunner(RunnerConfig(model=str(fp8_dir), num_pages=16, max_running=2, max_seq_len=128))


def test_flashinfer_mla_shapes_fp8_cache_and_tensor_parallelism_are_refused_for_latent_attention(tmp_path) -> None:
    hf = _build_deepseek("deepseek-v2-lite", seed=7)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    # flashinfer's MLA kernels take kv_lora_rank in multiples of 128: the tiny config's 32 is refused at start.
    with pytest.raises(ValueError, match="kv_lora_rank a multiple of 128.*KVFERRY_ATTENTION=torch"):
        ModelRunner(RunnerConfig(model=str(tmp_path), num_pages=16, max_running=2, attention="flashinfer"))
    with pytest.raises(ValueError, match="FP8 latent"):
        ModelRunner(RunnerConfig(model=str(tmp_path), num_pages=16, max_running=2, kv_dtype="fp8_e4m3"))
    with pytest.raises(ValueError, match="one rank"):
        TPShard.plan(named_config("deepseek-v2-lite"), 0, 2)


def test_flashinfer_mla_takes_the_released_shapes_and_refuses_heads_that_split_a_tile() -> None:
    from dataclasses import replace as dc_replace

    from common.engine.gpu.mla_attention import flashinfer_mla_unsupported

    lite = named_config("deepseek-v2-lite")  # 16 heads, rank 512, RoPE part 64
    for heads in (16, 8, 128):  # V2-Lite's, a smaller one, V2's and V3's
        assert flashinfer_mla_unsupported(dc_replace(lite, num_heads=heads)) is None
    why = flashinfer_mla_unsupported(dc_replace(lite, num_heads=24))
    assert why is not None and "24 heads" in why
    assert "multiple of 64" in (
        flashinfer_mla_unsupported(dc_replace(lite, mla=dc_replace(lite.mla, qk_rope_head_dim=32))) or ""
    )


def test_dummy_weights_serve_latent_attention() -> None:
    """`dummy:` weights (what the GPU benchmark's `dummy:deepseek-v2-lite` gets) on a small DeepSeek-V2 config:
    every MLA and expert tensor drawn, tokens generated, every page back."""
    from common.engine.model import DecoderModel
    from common.engine.weights import init_dummy_weights

    cfg = ModelConfig.from_hf_dict(
        dict(CONFIGS["deepseek-v2-lite"][1], model_type="deepseek_v2", vocab_size=VOCAB) | _SMALL
    )
    model = DecoderModel(cfg, torch.float32, torch.device("cpu"))
    init_dummy_weights(model, seed=3)
    assert all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in model.parameters())
    runner = ModelRunner(
        RunnerConfig(model="dummy:deepseek-v2-lite", num_pages=32, max_running=2, max_seq_len=256), model=model
    )
    engine = fresh_engine(runner)
    res = engine.generate(_random_prompts(4, [40]), SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True))[0]
    assert len(res.output_ids) == 8 and all(lp.logprob > -100 for lp in res.logprobs)
    assert_pool_clean(engine)


_SMALL = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6
)


def test_served_through_router_prefill_and_decode_equals_transformers(v3_checkpoint, smol_path) -> None:
    """One cluster (router, prefill worker, decode worker) on a random DeepSeek-V3 checkpoint; prompts past the
    router's disaggregation threshold, so their latent pages are prefilled on the prefill worker and sent over NIXL
    (page checksums checked on arrival). Every answer is transformers' greedy continuation."""
    from common.devcluster.cluster import start_local_cluster
    from router.surface.tokenizer import RouterTokenizer

    hf, path = v3_checkpoint
    env = {
        "KVFERRY_NUM_PAGES": "128",
        "KVFERRY_MAX_PREFILL_TOKENS": "64",
        "KVFERRY_MAX_RUNNING": "4",
        "KVFERRY_TORCH_THREADS": "1",
        "KVFERRY_DEBUG_CHECKSUMS": "1",
        "KVFERRY_ROUTER_TOKENIZER": str(smol_path),
        "KVFERRY_ROUTER_LOCAL_PREFIX_FRACTION": "2",  # prefill on the prefill pod, whatever the decode pod holds
    }
    prompts = _random_prompts(71, [300, 270, 260])
    tok = RouterTokenizer.from_dir(smol_path)
    cluster = start_local_cluster(prefill=1, decode=1, model=str(path), env=env, ready_timeout_s=300)
    try:
        for prompt in prompts:
            body = {"model": str(path), "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 1}
            r = httpx.post(f"{cluster.router_url}/v1/completions", json=body | {"ignore_eos": True}, timeout=180)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["logprobs"]["tokens"] == [tok.token_str(t) for t in hf_greedy(hf, prompt, 16)]
        decisions = httpx.get(f"{cluster.router_url}/router/workers").json()["decisions"]
        assert decisions.get("disaggregated") == len(prompts), decisions
    finally:
        cluster.stop()
