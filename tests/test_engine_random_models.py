"""The engine on small random-initialised checkpoints of every supported family, exact against transformers.

Each model is built by transformers from a config, saved with `save_pretrained` (safetensors) and loaded back
through `ModelRunner(RunnerConfig(model=<dir>))`, so the whole path (config parsing, weight name mapping,
merged qkv / gate_up, q/k norm, qkv bias, tied embeddings, RoPE scaling, mixture-of-experts layers) is checked
against transformers' own forward pass. RMSNorm weights and biases are re-drawn at random (transformers initialises them to
ones / zeros, which would hide a mis-mapped norm or bias).
"""

from __future__ import annotations

import pytest
import torch

from common.engine.runner import ModelRunner, RunnerConfig
from common.protocol import SamplingParams
from tests.engine_helpers import assert_pool_clean, fresh_engine

VOCAB = 1000
NEW_TOKENS = 32
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Wide init: logits spread by a few units, so greedy near-ties (float32 noise flipping an argmax) are rare.
    initializer_range=0.2,
)

# name -> (transformers config class name, extra config kwargs)
CONFIGS = {
    "qwen3-tied": ("Qwen3Config", dict(num_hidden_layers=3, tie_word_embeddings=True)),
    "qwen2-qkv-bias": ("Qwen2Config", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    "llama": ("LlamaConfig", dict(num_hidden_layers=4, tie_word_embeddings=False, rope_theta=10000.0)),
    "llama31-rope-llama3": (
        "LlamaConfig",
        dict(
            num_hidden_layers=2,
            tie_word_embeddings=False,
            # original_max_position_embeddings well below the prompts' lengths, so all three llama3
            # frequency bands (kept, scaled, smoothly interpolated) matter at the positions tested.
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, tie_word_embeddings=False, sliding_window=None)),
    # Mixtures of experts (common/engine/moe.py): top-2 of 8, renormalised, one layer dense (mlp_only_layers).
    "qwen3-moe-norm-topk": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=3,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # Top-2 weights as the softmax left them; every other layer sparse (decoder_sparse_step 2: layers 1 and 3).
    "qwen3-moe-raw-topk": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=4,
            tie_word_embeddings=True,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_hidden_layers=2, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2),
    ),
}


def _build_hf(config_cls: str, extra: dict, seed: int):
    import transformers

    cfg = getattr(transformers, config_cls)(**{**_COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def random_model(request, tmp_path_factory):
    """(name, transformers model, our runner over the same saved checkpoint); one per config per module."""
    name = request.param
    config_cls, extra = CONFIGS[name]
    hf = _build_hf(config_cls, extra, seed=1234)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path, safe_serialization=True)
    assert list(path.glob("*.safetensors")), "expected a safetensors checkpoint"
    runner = ModelRunner(RunnerConfig(model=str(path), num_pages=128, max_running=8, max_seq_len=512))
    mc = runner.model_config
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size) == (4, 2, 32, VOCAB)
    assert mc.qk_norm == config_cls.startswith("Qwen3")
    assert mc.qkv_bias == config_cls.startswith("Qwen2")
    assert mc.tie_word_embeddings == bool(extra["tie_word_embeddings"])
    # The layers whose MLP is a mixture of experts: the same ones as transformers' model.
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert list(mc.moe.layers if mc.moe is not None else ()) == sparse
    if "rope_parameters" in extra:
        assert mc.rope.kind == "llama3" and mc.rope.factor == 8.0 and mc.rope.original_max_position == 64
    return name, hf, runner


def _random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@torch.inference_mode()
def _hf_greedy_with_margin(hf, prompt: list[int], n: int) -> tuple[list[int], float]:
    """transformers' greedy continuation and the smallest top-1/top-2 logit gap along it."""
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    top2 = torch.cat(out.logits).float().topk(2, dim=-1).values
    return out.sequences[0, len(prompt) :].tolist(), float((top2[:, 0] - top2[:, 1]).min())


def _check_greedy(hf, prompts: list[list[int]], results) -> None:
    for i, (prompt, res) in enumerate(zip(prompts, results)):
        ref, margin = _hf_greedy_with_margin(hf, prompt, NEW_TOKENS)
        # A top-2 gap near float32 noise makes the comparison meaningless; re-seed the model if this trips.
        assert margin > 1e-4, f"prompt {i}: greedy near-tie in the reference (gap {margin:.2e})"
        assert res.finish_reason == "length"
        assert res.output_ids == ref, f"prompt {i} (len {len(prompt)}) diverges"


def test_teacher_forced_logits_match_transformers(random_model):
    _, hf, runner = random_model
    engine = fresh_engine(runner)
    # Long enough to cross the llama3 original context (64) and several KV pages.
    for ids in _random_prompts(7, [1, 9, 150]):
        ours = engine.score(ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape == (len(ids), VOCAB)
        assert float(ref.std()) > 1.0, "logits too flat to tell models apart"
        torch.testing.assert_close(ours, ref, atol=5e-4, rtol=1e-4)
    assert_pool_clean(engine)


def test_logits_only_for_sampled_tokens(random_model):
    """One prefill step asked for every token's logits, for each request's last token, for one request's, and
    for none (a chunk where no request samples yet): the same rows each time, and an empty float32 tensor."""
    _, _, runner = random_model
    prompts = _random_prompts(5, [37, 20])
    pt, ps = runner.page_table, runner.cfg.page_size
    rows, first = [], 0
    for prompt in prompts:
        n = -(-len(prompt) // ps)
        rows.append(pt.take_row())
        pt.write_pages(rows[-1], 0, torch.arange(first, first + n))
        first += n

    def step(mask: list[bool], all_logits: bool = False) -> torch.Tensor:
        return runner.forward(runner.build_batch(prompts, [0, 0], rows, mask, False, all_logits)).clone()

    try:
        every = step([True, True], all_logits=True)
        assert every.shape == (57, VOCAB) and every.dtype == torch.float32
        torch.testing.assert_close(step([True, True]), every[[36, 56]], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step([False, True]), every[[56]], atol=1e-5, rtol=1e-5)
        none = step([False, False])
        assert none.shape == (0, VOCAB) and none.dtype == torch.float32
    finally:
        for row in rows:
            pt.give_row(row)


def test_greedy_concurrent_chunked_batch_matches_transformers(random_model):
    _, hf, runner = random_model
    prompts = _random_prompts(11, [5, 23, 40, 77, 130, 3])
    budget = 32
    assert budget < max(len(p) for p in prompts)  # the long prompts take several chunked-prefill steps
    engine = fresh_engine(runner, max_prefill_tokens=budget)
    results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    _check_greedy(hf, prompts, results)
    assert_pool_clean(engine)


def test_shared_prefix_hits_radix_cache_and_stays_exact(random_model):
    _, hf, runner = random_model
    prefix = _random_prompts(21, [53])[0]
    suffixes = _random_prompts(22, [4, 9, 17, 30, 1, 12])
    prompts = [prefix + s for s in suffixes]
    engine = fresh_engine(runner, max_prefill_tokens=48)
    sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    first = engine.generate(prompts[:1], sp)[0]
    assert first.cached_tokens == 0
    rest = engine.generate(prompts[1:], sp)
    page = runner.cfg.page_size
    for res in rest:
        # Every whole page of the shared prefix comes from the cache.
        assert res.cached_tokens >= len(prefix) // page * page > 0, res.cached_tokens
    _check_greedy(hf, prompts, [first, *rest])
    assert_pool_clean(engine)


@pytest.mark.parametrize(
    "starts, extends",
    [
        ([0, 0, 0], [20, 18, 21]),  # fresh prefill, similar lengths: one padded SDPA call
        ([0, 0, 0], [3, 70, 9]),  # lengths far apart: one causal call per request
        ([40, 0, 17], [25, 4, 30]),  # cached prefixes (chunked prefill / prefix hit): per-request masks
        ([33, 33, 30], [12, 11, 12]),  # cached prefixes, similar lengths: padded with an offset causal mask
        ([0], [50]),  # one request
        ([64], [17]),  # one request continuing a cached prefix
        ([5, 90, 31, 0], [1, 1, 1, 1]),  # decode
        ([0, 0], [1, 1]),  # one-token prompts
    ],
)
@pytest.mark.parametrize("layout", ["auto", "padded", "segments"])
def test_paged_attention_layouts_match_dense_reference(starts, extends, layout):
    """TorchPagedAttention over shuffled pages equals plain causal attention over each request's full sequence."""
    from common.engine.attention import TorchPagedAttention
    from common.kv.pool import KVLayout, KVPool

    gen = torch.Generator().manual_seed(sum(starts) + 7 * sum(extends))
    hq, hkv, d, ps, num_pages = 4, 2, 32, 16, 64
    pool = KVPool(KVLayout(1, hkv, d, ps, torch.float32), num_pages)
    runner_table = torch.zeros((len(starts) + 1, 256), dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=gen)
    seqs = [s + n for s, n in zip(starts, extends)]
    full_k = [torch.randn(s, hkv, d, generator=gen) for s in seqs]
    full_v = [torch.randn(s, hkv, d, generator=gen) for s in seqs]
    used = 0
    for i, s in enumerate(seqs):  # scattered pages; the cached prefix is already in the pool
        n_pages = -(-s // ps)
        pages = perm[used : used + n_pages]
        used += n_pages
        locs = (pages[:, None] * ps + torch.arange(ps)).flatten()[:s]
        runner_table[i, :s] = locs.to(torch.int32)
        pool.rows[pool.token_rows(locs[: starts[i]]) + pool.layer_offset(0, 0)] = full_k[i][: starts[i]]
        pool.rows[pool.token_rows(locs[: starts[i]]) + pool.layer_offset(0, 1)] = full_v[i][: starts[i]]
    q = torch.randn(sum(extends), hq, d, generator=gen)
    k = torch.cat([fk[s:] for fk, s in zip(full_k, starts)])
    v = torch.cat([fv[s:] for fv, s in zip(full_v, starts)])
    ext_t = torch.tensor(extends)
    q_start = torch.cumsum(ext_t, 0) - ext_t
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, extends)])
    rows = torch.repeat_interleave(torch.arange(len(starts)), ext_t)
    from common.engine.forward_batch import ForwardBatch

    batch = ForwardBatch(
        is_decode=max(extends) == 1,
        input_ids=torch.zeros(sum(extends), dtype=torch.int64),
        positions=positions,
        out_loc=runner_table[rows, positions].to(torch.int64),
        seq_lens=torch.tensor(seqs),
        extend_lens=ext_t,
        q_start=q_start,
        table_rows=torch.arange(len(starts)),
        logits_indices=q_start + ext_t - 1,
        seq_lens_cpu=seqs,
        extend_lens_cpu=extends,
    )
    from common.engine.layers import RotaryCache

    # Identity RoPE (cos 1, sin 0): this test is about the paged layouts; RoPE has its own tests.
    n_pos = max(seqs) + 1
    identity = RotaryCache(cos=torch.ones(n_pos, d // 2), sin=torch.zeros(n_pos, d // 2))
    attn = TorchPagedAttention(pool, runner_table, hq, d, identity)
    attn.prefill_layout = layout
    attn.plan(batch)
    if layout != "auto" and max(extends) > 1:
        assert (attn._segments is not None) == (layout == "segments")
    out = attn.forward(0, positions, q, k, v)

    group = hq // hkv
    for i, (s, n) in enumerate(zip(starts, extends)):
        qi = q[q_start[i] : q_start[i] + n].transpose(0, 1)  # [Hq, n, D]
        ki = full_k[i].transpose(0, 1).repeat_interleave(group, 0)  # [Hq, S, D]
        vi = full_v[i].transpose(0, 1).repeat_interleave(group, 0)
        scores = qi @ ki.transpose(1, 2) * d**-0.5
        causal = torch.arange(s + n)[None, :] <= torch.arange(s, s + n)[:, None]
        ref = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vi).transpose(0, 1)
        torch.testing.assert_close(out[q_start[i] : q_start[i] + n], ref, atol=1e-5, rtol=1e-5)
        # This step's K/V landed in the pool at the request's slots.
        locs = runner_table[i, s : s + n].to(torch.int64)
        assert torch.equal(pool.rows[pool.token_rows(locs) + pool.layer_offset(0, 0)], full_k[i][s:])
