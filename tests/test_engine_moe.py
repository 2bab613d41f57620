"""Mixture-of-experts layers (common/engine/moe.py) beyond what tests/test_engine_random_models.py checks for every
family: the routing and grouped experts against plain references, logprobs against transformers', checkpoints
that lack an expert, the configurations refused, and one random Qwen3-MoE checkpoint served through the router, a
prefill worker, NIXL and a decode worker, token for token what transformers' greedy decoding gives."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from common.engine.fp8 import FP8_SETTING
from common.engine.gpu.moe_experts import grouped_mm_experts
from common.engine.model_config import ModelConfig, MoeConfig
from common.engine.moe import grouped_experts, route
from common.engine.named_configs import named_config
from common.engine.runner import ModelRunner, RunnerConfig
from common.protocol import SamplingParams
from tests.engine_helpers import assert_pool_clean, fresh_engine
from tests.test_engine_random_models import CONFIGS, _build_hf, _random_prompts

MOE = "qwen3-moe-norm-topk"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """(transformers model, its saved checkpoint's directory) of a random Qwen3-MoE (one dense layer)."""
    hf = _build_hf(*CONFIGS[MOE], seed=1234)
    path = tmp_path_factory.mktemp("qwen3-moe")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def _gating(experts: int, top_k: int, renormalize: bool) -> MoeConfig:
    """Softmax top-k gating (Qwen3-MoE, Mixtral); the sizes of the experts do not matter to routing."""
    return MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=1, renormalize=renormalize, layers=())


def test_route_softmax_top_k_renormalised_or_not() -> None:
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 3.0, 0.5]])
    probs = logits.softmax(-1)
    raw_w, raw_ids = route(logits, _gating(4, 2, renormalize=False))
    assert raw_ids.tolist() == [[0, 2], [2, 3]]
    torch.testing.assert_close(raw_w, probs.gather(1, raw_ids))
    norm_w, norm_ids = route(logits, _gating(4, 2, renormalize=True))
    assert torch.equal(norm_ids, raw_ids)
    torch.testing.assert_close(norm_w, raw_w / raw_w.sum(-1, keepdim=True))
    assert norm_w.dtype == torch.float32


@pytest.mark.parametrize("tokens", [0, 1, 7, 50])
def test_grouped_experts_equal_every_expert_on_every_token(tokens: int) -> None:
    """The grouped path against all experts run densely on all tokens and picked per token; with 8 experts and
    few tokens some experts get none."""
    gen = torch.Generator().manual_seed(tokens)
    e, h, i, k = 8, 16, 12, 2
    x = torch.randn(tokens, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen)
    w2 = torch.randn(e, h, i, generator=gen)
    weights, ids = route(torch.randn(tokens, e, generator=gen), _gating(e, k, renormalize=True))
    gate, up = torch.einsum("th,eoh->eto", x, w13).chunk(2, dim=-1)
    every = torch.einsum("eti,ehi->eth", F.silu(gate) * up, w2)  # [E, T, H]
    picked = every[ids, torch.arange(tokens).unsqueeze(1)]  # [T, k, H]
    ref = (picked * weights.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(grouped_experts(x, weights, ids, w13, w2), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 7, 50])
def test_grouped_gemm_experts_equal_the_plain_ones(tokens: int) -> None:
    """The GPU path's experts (two grouped GEMMs, no host sync, outputs summed per token by one batched GEMM) on
    torch's CPU grouped GEMM: the same sums as the plain path, float32; on the GPU the CUTLASS kernel is checked
    by tests/test_gpu_path.py through the whole model."""
    gen = torch.Generator().manual_seed(100 + tokens)
    e, h, i, k = 8, 16, 12, 3
    x = torch.randn(tokens, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen)
    w2 = torch.randn(e, h, i, generator=gen)
    weights, ids = route(torch.randn(tokens, e, generator=gen), _gating(e, k, renormalize=False))
    torch.testing.assert_close(
        grouped_mm_experts(x, weights, ids, w13, w2), grouped_experts(x, weights, ids, w13, w2), atol=1e-5, rtol=1e-5
    )


def test_configs_read_from_hf_fields() -> None:
    big = named_config("qwen3-30b-a3b")
    assert big.moe is not None and big.qk_norm
    assert (big.moe.num_experts, big.moe.top_k, big.moe.intermediate_size, big.moe.renormalize) == (128, 8, 768, True)
    assert big.moe.layers == tuple(range(48))
    # Qwen3-MoE's published configs name the expert count num_experts; Mixtral renormalises without saying so.
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_attention_heads=2, num_experts_per_tok=2)
    qwen = dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=8, num_hidden_layers=4)
    qwen |= dict(decoder_sparse_step=2, mlp_only_layers=[3])
    moe = ModelConfig.from_hf_dict({**base, **qwen}).moe
    assert moe is not None and moe.layers == (1,) and not moe.renormalize
    mixtral = ModelConfig.from_hf_dict(
        {**base, "model_type": "mixtral", "num_local_experts": 4, "num_hidden_layers": 2}
    ).moe
    assert mixtral is not None and mixtral.renormalize and mixtral.intermediate_size == 16 and mixtral.layers == (0, 1)
    with pytest.raises(ValueError, match="shared experts"):
        ModelConfig.from_hf_dict({**base, **qwen, "shared_expert_intermediate_size": 8})


def test_greedy_logprobs_match_transformers(moe_dir) -> None:
    hf, path = moe_dir
    runner = ModelRunner(RunnerConfig(model=str(path), num_pages=64, max_running=4, max_seq_len=512))
    engine = fresh_engine(runner, max_prefill_tokens=32)
    prompts = _random_prompts(31, [9, 70])
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True)
    for prompt, res in zip(prompts, engine.generate(prompts, sp)):
        seq = torch.tensor([prompt + res.output_ids])
        with torch.inference_mode():
            logp = hf(seq).logits[0].float().log_softmax(-1)
        rows = logp[len(prompt) - 1 : -1]
        assert res.output_ids == rows.argmax(-1).tolist()  # greedy, teacher-forced on our own continuation
        ref = rows.gather(1, torch.tensor(res.output_ids).unsqueeze(1)).squeeze(1)
        ours = torch.tensor([lp.logprob for lp in res.logprobs])
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert_pool_clean(engine)


def test_a_checkpoint_without_an_expert_is_refused(moe_dir, tmp_path) -> None:
    _, path = moe_dir
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    (shard,) = path.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / shard.name, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layer 2 expert 5 up"):
        ModelRunner(RunnerConfig(model=str(tmp_path), num_pages=16, max_running=2, max_seq_len=128))


def test_fp8_weights_are_refused_for_experts(moe_dir) -> None:
    _, path = moe_dir
    with pytest.raises(ValueError, match="FP8 experts are not supported"):
        ModelRunner(
            RunnerConfig(model=str(path), num_pages=16, max_running=2, max_seq_len=128, weight_dtype=FP8_SETTING)
        )


def test_served_through_router_prefill_and_decode_equals_transformers(moe_dir, smol_path) -> None:
    """One cluster (router, prefill worker, decode worker) on the random checkpoint; the router tokenizes with the
    packaged tokenizer (the prompt is token ids, all within the model's vocabulary). The prompt is past the
    router's disaggregation threshold, so its KV is prefilled on the prefill worker and sent over NIXL."""
    from common.devcluster.cluster import start_local_cluster
    from router.surface.tokenizer import RouterTokenizer
    from tests.engine_helpers import hf_greedy

    hf, path = moe_dir
    env = {
        "KVFERRY_NUM_PAGES": "128",
        "KVFERRY_MAX_PREFILL_TOKENS": "64",
        "KVFERRY_MAX_RUNNING": "4",
        "KVFERRY_TORCH_THREADS": "1",
        "KVFERRY_DEBUG_CHECKSUMS": "1",
        "KVFERRY_ROUTER_TOKENIZER": str(smol_path),
        "KVFERRY_ROUTER_LOCAL_PREFIX_FRACTION": "2",  # prefill on the prefill pod, whatever the decode pod holds
    }
    prompt = _random_prompts(41, [300])[0]
    want = hf_greedy(hf, prompt, 24)
    tok = RouterTokenizer.from_dir(smol_path)
    cluster = start_local_cluster(prefill=1, decode=1, model=str(path), env=env, ready_timeout_s=300)
    try:
        body = {"model": str(path), "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 1}
        body |= {"ignore_eos": True}
        r = httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["logprobs"]["tokens"] == [tok.token_str(t) for t in want]
        decisions = httpx.get(f"{cluster.router_url}/router/workers").json()["decisions"]
        assert decisions.get("disaggregated") == 1, decisions
    finally:
        cluster.stop()


def test_dummy_weights_of_tp_ranks_are_slices_of_every_expert() -> None:
    """`dummy:` MoE weights under tensor parallelism: each rank holds its slice of every expert's intermediate dim of
    the same full draw (so TP=N runs the TP=1 model), the router whole."""
    from common.engine.model import DecoderModel
    from common.engine.tp import TPGroup, TPShard
    from common.engine.weights import init_dummy_weights

    base = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_attention_heads=2, num_hidden_layers=1)
    cfg = ModelConfig.from_hf_dict({**base, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2})
    models = []
    for tp in (None, *(TPGroup(TPShard.plan(cfg, r, 2)) for r in range(2))):
        models.append(DecoderModel(cfg, torch.float32, torch.device("cpu"), tp))
        init_dummy_weights(models[-1], seed=3)
    full, *ranks = (m.layers[0].moe for m in models)
    gate, up = full.w13.chunk(2, dim=1)
    for r, (lo, hi) in zip(ranks, ((0, 12), (12, 24))):
        assert torch.equal(r.gate, full.gate)
        assert torch.equal(r.w13, torch.cat((gate[:, lo:hi], up[:, lo:hi]), dim=1))
        assert torch.equal(r.w2, full.w2[:, :, lo:hi])
