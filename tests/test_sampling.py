"""Sampling: the Gumbel/counter-hash sampler on tiny tensors, and per-request behaviour on the real SmolLM2."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import ValidationError

from common.engine.sampling import SamplingBatch, adjust_logits, sample, token_counts, uniform_noise
from common.protocol import MAX_TOP_LOGPROBS, SamplingParams, convert, replace
from tests.engine_helpers import TEST_GRAMMAR_COMPILE_TIMEOUT_S, assert_pool_clean, fresh_engine

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _batch(params: list[SamplingParams], seeds: list[int] | None = None, outputs=None, vocab: int = 0) -> SamplingBatch:
    seeds = seeds if seeds is not None else [p.seed or 0 for p in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingBatch.build(params, seeds, vocab, CPU, steps=[len(o) for o in outputs], outputs=outputs)


def _sample_many(logits: torch.Tensor, sp: SamplingParams, n: int, step_offset: int = 0) -> torch.Tensor:
    """Draws `n` tokens from one logits row: one batch row per (seed, step) pair, all independent draws."""
    sb = _batch([sp] * n, seeds=list(range(n)), vocab=logits.shape[-1])
    sb.steps = torch.arange(n, dtype=torch.int64) % 7 + step_offset
    return sample(logits.expand(n, -1).contiguous(), sb).tokens


# ---- greedy ---------------------------------------------------------------------------------------------


def test_greedy_equals_top_k_1_at_temperature_1():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0)) * 3
    greedy = sample(logits, _batch([SamplingParams()] * 8, vocab=100)).tokens
    assert torch.equal(greedy, logits.argmax(-1))
    top1 = [SamplingParams(temperature=1.0, top_k=1, seed=s) for s in range(8)]
    assert all(p.greedy for p in top1)
    assert torch.equal(sample(logits, _batch(top1, vocab=100)).tokens, greedy)
    # Force the stochastic path (temperature 1, top-k filter, Gumbel noise): top-1 still leaves only the argmax.
    sb = _batch(top1, vocab=100)
    sb.temperature = torch.ones(8)
    sb.all_greedy, sb.needs_filter = False, True
    for step in range(5):
        sb.steps = torch.full((8,), step, dtype=torch.int64)
        assert torch.equal(sample(logits, sb).tokens, greedy)


def test_greedy_equals_top_k_1_on_real_model(smol_runner, smol_tokenizer):
    prompts = [smol_tokenizer.encode("The capital of France is"), smol_tokenizer.encode("def fibonacci(n):")]
    engine = fresh_engine(smol_runner)
    greedy = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    top1 = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, top_k=1, seed=9))
    assert [r.output_ids for r in greedy] == [r.output_ids for r in top1]
    assert_pool_clean(engine)


# ---- the noise source ------------------------------------------------------------------------------------


def test_uniform_noise_depends_only_on_seed_step_and_id():
    seeds = torch.tensor([5, 2**40 + 3, 5, 123456789012345], dtype=torch.int64)
    steps = torch.tensor([0, 0, 1, 7], dtype=torch.int64)
    u = uniform_noise(seeds, steps, 1000)
    assert u.shape == (4, 1000) and float(u.min()) > 0.0 and float(u.max()) < 1.0
    for i in range(4):  # a row does not depend on what else is in the batch
        assert torch.equal(u[i], uniform_noise(seeds[i : i + 1], steps[i : i + 1], 1000)[0])
    assert not torch.equal(u[0], u[2])  # next step: fresh draws
    # Seeds differing only in their high 32 bits give different streams.
    hi = uniform_noise(torch.tensor([5 + (1 << 33)]), torch.tensor([0]), 1000)[0]
    assert not torch.equal(u[0], hi)
    big = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert abs(float(big.mean()) - 0.5) < 0.005
    assert abs(float(big.var()) - 1 / 12) < 0.002


# ---- distributions --------------------------------------------------------------------------------------

LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0, 1.5, 0.25])
N_DRAWS = 40000


def _check_frequencies(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    freq = torch.bincount(tokens, minlength=expected.numel()).double() / tokens.numel()
    sigma = (expected * (1 - expected) / tokens.numel()).sqrt()
    # 5 sigma per bin; exactly-zero bins must stay exactly zero.
    assert bool(((freq - expected).abs() <= 5 * sigma + 1e-12).all()), (freq.tolist(), expected.tolist())
    chi2 = float((((freq - expected) ** 2) / expected.clamp_min(1e-12))[expected > 0].sum() * tokens.numel())
    dof = int((expected > 0).sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), chi2


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_temperature_frequencies_match_softmax(temperature):
    tokens = _sample_many(LOGITS, SamplingParams(temperature=temperature), N_DRAWS)
    _check_frequencies(tokens, (LOGITS.double() / temperature).softmax(-1))


@pytest.mark.parametrize(
    "kwargs, kept",
    [
        # LOGITS ranked: 4 (2.0), 6 (1.5), 0 (1.0), 1 (0.5), 7 (0.25), 2 (0.0), 3 (-0.5), 5 (-3.0)
        (dict(top_k=3), [4, 6, 0]),
        (dict(min_p=0.35), [4, 6, 0]),  # p/p_max = exp(l - 2): 1, .61, .37, .22, ...
        (dict(top_p=0.5), [4, 6]),  # probs .30 .18 .11 ...: mass before #2 is .30 < .5, before #3 .48 < .5, ...
    ],
)
def test_filtered_frequencies_match_renormalised_softmax(kwargs, kept):
    probs = LOGITS.double().softmax(-1)
    if "top_p" in kwargs:  # recompute the expected set from the rule: keep while the mass before < p
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]
        kept = order[before < kwargs["top_p"]].tolist()
    expected = torch.zeros_like(probs)
    expected[kept] = probs[kept] / probs[kept].sum()
    tokens = _sample_many(LOGITS, SamplingParams(temperature=1.0, **kwargs), N_DRAWS // 2)
    assert set(tokens.unique().tolist()) == set(kept)
    _check_frequencies(tokens, expected)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    vocab=st.integers(2, 40),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(-1, 45),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_filters_never_pick_a_filtered_token(data, vocab, temperature, top_k, top_p, min_p):
    values = data.draw(st.lists(st.floats(-20, 20, allow_nan=False), min_size=vocab, max_size=vocab))
    logits = torch.tensor(values, dtype=torch.float32)
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = _sample_many(logits, sp, 64, step_offset=data.draw(st.integers(0, 1000)))
    if sp.greedy:
        assert bool((tokens == logits.argmax()).all())
        return
    # Reference in float64, permissive at ties and rounding: a token the sampler may keep must pass all three.
    scaled = (logits / temperature).double()
    probs = scaled.softmax(-1)
    allowed = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        allowed &= scaled >= scaled.sort(descending=True).values[top_k - 1]
    mass_above = (probs[None, :] * (scaled[None, :] > scaled[:, None])).sum(-1)
    allowed &= mass_above < top_p + 1e-5
    allowed &= probs >= min_p * probs.max() * (1 - 1e-5)
    assert bool(allowed[logits.argmax()])
    assert bool(allowed[tokens].all()), (tokens.tolist(), allowed.nonzero().flatten().tolist())


# ---- penalties ------------------------------------------------------------------------------------------


def test_frequency_and_presence_penalties_move_the_argmax():
    logits = torch.tensor([[5.0, 4.5, 0.0, 1.0]] * 6)
    outputs = [[0, 0, 0, 3]] * 6  # token 0 produced three times, token 3 once
    params = [
        SamplingParams(),  # no penalty: 0
        SamplingParams(frequency_penalty=0.2),  # 5 - 3*0.2 = 4.4 < 4.5: 1
        SamplingParams(frequency_penalty=0.1),  # 5 - 0.3 = 4.7: still 0
        SamplingParams(presence_penalty=0.6),  # 5 - 0.6 = 4.4: 1 (counted once, however often it came)
        SamplingParams(presence_penalty=0.4),  # 4.6: still 0
        SamplingParams(frequency_penalty=-2.0, presence_penalty=-2.0),  # promotes: 5 + 6 + 2 for token 0: 0
    ]
    tokens = sample(logits, _batch(params, outputs=outputs, vocab=4)).tokens.tolist()
    assert tokens == [0, 1, 0, 1, 0, 0]
    # A negative penalty promotes a produced token over an unproduced one.
    promote = sample(
        torch.tensor([[1.0, 4.0, 0.0, 3.5]]), _batch([SamplingParams(presence_penalty=-1.0)], outputs=[[3]], vocab=4)
    )
    assert promote.tokens.tolist() == [3]
    # Penalties apply to the request's own outputs only, never to its batch neighbours.
    mixed = sample(
        torch.tensor([[5.0, 4.5, 0.0, 1.0]] * 2),
        _batch([SamplingParams(presence_penalty=1.0), SamplingParams()], outputs=[[0], [0]], vocab=4),
    )
    assert mixed.tokens.tolist() == [1, 0]
    # Logprobs stay those of the raw model distribution.
    lp = sample(
        logits[:1], _batch([SamplingParams(frequency_penalty=0.2, logprobs=True)], outputs=outputs[:1], vocab=4)
    )
    assert lp.tokens.tolist() == [1]
    assert float(lp.logprobs[0]) == pytest.approx(float(logits[0].log_softmax(-1)[1]), abs=1e-6)


def _dense_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    """The penalties as elementwise passes over every [B, V] logit: what the sparse application must equal."""
    vocab, device = logits.shape[1], logits.device
    counts = token_counts(outputs, vocab).to(device)
    seen = token_counts([p + o for p, o in zip(prompts, outputs)], vocab).to(device) > 0

    def col(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)[:, None]

    rep = col("repetition_penalty")
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - col("frequency_penalty") * counts - col("presence_penalty") * (counts > 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_sparse_penalties_equal_the_dense_pass_bit_for_bit(device: str) -> None:
    """Penalties gathered at each row's history ids and scattered back give the dense formula's float32 logits
    exactly: ids repeated in the prompt and output, rows without penalties, repetition-only rows, rows with
    no history, zero and negative logits; in place, or on a copy when logprobs read the raw logits."""
    rng = random.Random(7)
    batch, vocab, longest = (128, 128_256, 1500) if device == "cuda" else (40, 700, 90)
    kinds = [
        dict(),
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.8),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=-1.1),
        dict(frequency_penalty=-0.4, presence_penalty=0.9, repetition_penalty=1.1),
        dict(frequency_penalty=2.0, presence_penalty=0.3, repetition_penalty=1.7),
    ]
    for trial in range(4):
        params, prompts, outputs = [], [], []
        for _ in range(batch):
            pool = [rng.randrange(vocab) for _ in range(rng.choice([3, 30, vocab]))]  # few ids: many repeats
            shape = rng.choice(["empty", "prompt", "output", "both", "both"])
            prompts.append([rng.choice(pool) for _ in range(rng.randrange(1, longest))] if shape != "output" else [])
            outputs.append([rng.choice(pool) for _ in range(rng.randrange(1, longest))] if shape != "prompt" else [])
            if shape == "empty":
                prompts[-1], outputs[-1] = [], []
            params.append(SamplingParams(logprobs=trial % 2 == 1, **rng.choice(kinds)))
        gen = torch.Generator().manual_seed(trial)
        logits = (torch.randn(batch, vocab, generator=gen) * 4).to(device)
        logits[:, 3::5] = 0.0
        logits[:, 1::9] = -0.0
        expected = _dense_penalties(logits, params, prompts, outputs)
        steps = [len(o) for o in outputs]
        sb = SamplingBatch.build(params, [0] * batch, vocab, torch.device(device), steps, prompts, outputs)
        given = logits.clone()
        assert torch.equal(adjust_logits(given, sb), expected)
        assert torch.equal(given, logits if sb.want_logprobs else expected)  # raw kept for logprobs
        assert torch.equal(sample(logits.clone(), sb).tokens, expected.argmax(-1))


@needs_cuda
def test_penalty_record_kernel_appends_and_counts_like_the_torch_ops() -> None:
    from common.engine.gpu.penalty import record

    gen = torch.Generator().manual_seed(7)
    rows_total, capacity, vocab, batch = 300, 700, 128_256, 200
    ids = torch.randint(0, vocab, (rows_total, capacity), generator=gen).cuda()
    counts = torch.randint(0, 3, (rows_total, vocab), generator=gen).float().cuda()
    rows = torch.randperm(rows_total, generator=gen)[:batch].cuda()  # distinct, as in a batch
    start = torch.randint(-50, 300, (batch,), generator=gen).cuda()
    steps = torch.randint(50, 350, (batch,), generator=gen).cuda()
    tokens = torch.randint(0, vocab, (batch,), generator=gen).cuda()
    want_ids, want_counts = ids.clone(), counts.clone()
    want_ids.index_put_((rows, start + steps), tokens)
    want_counts.view(-1).index_add_(0, rows * vocab + tokens, torch.ones(batch, device="cuda"))
    record(ids, counts, rows, start, steps, tokens)
    assert torch.equal(ids, want_ids) and torch.equal(counts, want_counts)


def test_uniform_noise_never_reaches_one():
    """u = 1 would give +inf Gumbel noise: that token would win whatever its logit (NaN against a mask)."""
    top = torch.tensor([(1 << 32) - 1], dtype=torch.int64)  # the largest hash value, through the same scaling
    assert float(((top >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))) < 1.0
    u = uniform_noise(torch.arange(256), torch.zeros(256, dtype=torch.int64), 49152)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0


def test_logit_bias_bans_forces_and_stays_per_request():
    logits = torch.tensor([[5.0, 4.5, 0.0, 1.0]] * 3)
    params = [SamplingParams(logit_bias={0: -100.0}), SamplingParams(logit_bias={2: 100.0}), SamplingParams()]
    assert sample(logits.clone(), _batch(params, vocab=4)).tokens.tolist() == [1, 2, 0]  # biases go in in place
    # Sampled too: a -100 bias is a ban in practice, whatever the draw.
    hot = [SamplingParams(temperature=2.0, seed=s, logit_bias={0: -100.0, 1: -100.0}) for s in range(64)]
    tokens = sample(logits[:1].expand(64, -1).contiguous(), _batch(hot, vocab=4)).tokens
    assert set(tokens.tolist()) <= {2, 3}
    with pytest.raises(ValidationError):
        convert({"logit_bias": {1: 101.0}}, SamplingParams)
    with pytest.raises(ValidationError):
        convert({"logit_bias": {-1: 1.0}}, SamplingParams)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[1.0, 9.0, 8.0, 0.0]] * 3)  # token 1 is EOS, token 2 a stop id
    params = [SamplingParams(min_tokens=3, stop_token_ids=[2])] * 3
    sb = SamplingBatch.build(params, [0, 0, 0], 4, CPU, steps=[0, 2, 3], eos_ids=(1,))
    assert sample(logits.clone(), sb).tokens.tolist() == [0, 0, 1]  # banned at steps 0 and 2 (in place), free at 3
    ignore = SamplingParams(min_tokens=3, ignore_eos=True)
    sb = SamplingBatch.build([ignore], [0], 4, CPU, steps=[0], eos_ids=(1,))
    assert sample(logits[:1], sb).tokens.tolist() == [1]  # EOS is no end with ignore_eos: nothing to hold back


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.tensor([[4.0, 3.0, -1.0, -2.0]] * 3)
    params = [SamplingParams(repetition_penalty=1.5)] * 2 + [SamplingParams()]
    prompts, outputs = [[0], [], [0]], [[], [0], [0]]
    sb = SamplingBatch.build(params, [0] * 3, 4, CPU, steps=[0, 1, 1], prompts=prompts, outputs=outputs)
    # 4 / 1.5 = 2.67 < 3: token 0, seen in the prompt (row 0) or the output (row 1), loses to token 1.
    assert sample(logits, sb).tokens.tolist() == [1, 1, 0]
    neg = torch.tensor([[-1.0, -1.2, -5.0, -5.0]])
    sb = SamplingBatch.build([SamplingParams(repetition_penalty=1.5)], [0], 4, CPU, steps=[1], outputs=[[0]])
    assert sample(neg, sb).tokens.tolist() == [1]  # a negative logit is multiplied: -1.5 < -1.2


def test_grammar_bitmask_allows_only_its_tokens():
    vocab = 70
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))
    bits = torch.full((2, 3), -1, dtype=torch.int32)  # row 1: unconstrained
    bits[0] = 0
    bits[0, 1] = -(1 << 31)  # bit 31 (the sign bit of int32): token 63
    bits[0, 2] = 1 << 3  # token 67
    params = [SamplingParams(temperature=1.0, seed=s) for s in (0, 1)]
    for step in range(20):
        sb = _batch(params, vocab=vocab)
        sb.steps = torch.full((2,), step, dtype=torch.int64)
        sb.allowed_bits = bits
        assert sample(logits, sb).tokens[0].item() in (63, 67)
    sb = _batch([SamplingParams(), SamplingParams()], vocab=vocab)
    sb.allowed_bits = bits
    tokens = sample(logits, sb).tokens.tolist()
    assert tokens[0] == (63 if logits[0, 63] > logits[0, 67] else 67) and tokens[1] == int(logits[1].argmax())
    # A grammar that allows only tokens min_tokens bans (a done grammar allows only its end): the grammar wins,
    # never an all -inf row.
    held = SamplingParams(min_tokens=5, stop_token_ids=[63, 67])
    sb = SamplingBatch.build([held, SamplingParams()], [0, 0], vocab, CPU, steps=[0, 0], grammar_done=[True, False])
    sb.allowed_bits, sb.grammar_rows = bits, [0]
    assert sample(logits, sb).tokens.tolist() == tokens


# ---- seeds on the real model ----------------------------------------------------------------------------

SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)


def test_seeded_request_reproducible_alone_in_batch_and_across_engines(smol_runner, smol_tokenizer):
    target = smol_tokenizer.encode("Once upon a time, in a land far away, there lived a dragon who loved to")
    others = [
        smol_tokenizer.encode("The capital of France is"),
        smol_tokenizer.encode("List three colors of the rainbow: red, green and"),
        smol_tokenizer.encode("def fibonacci(n):\n    "),
    ]
    alone = fresh_engine(smol_runner).generate([target], SEEDED)[0].output_ids
    assert len(alone) == 16

    engine = fresh_engine(smol_runner, max_prefill_tokens=16)  # chunked prefill, a different batch every step
    neighbours = [
        SamplingParams(max_tokens=5, temperature=1.3, seed=1),
        SamplingParams(max_tokens=20, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, top_k=40, seed=7, ignore_eos=True),
    ]
    batched = engine.generate([others[0], target, others[1], others[2]], [neighbours[0], SEEDED, *neighbours[1:]])
    assert batched[1].output_ids == alone
    # Again now that the prompt's first page comes from the prefix cache.
    again = engine.generate([target], SEEDED)[0]
    assert again.cached_tokens > 0 and again.output_ids == alone
    # A different seed draws a different continuation.
    other_seed = engine.generate([target], replace(SEEDED, seed=43))[0].output_ids
    assert other_seed != alone
    assert_pool_clean(engine)
    # And on another fresh engine. (Engines over one runner share its KV pool, so an engine must not be used
    # again once a newer one has run: its prefix cache would point at pages the newer one overwrote.)
    assert fresh_engine(smol_runner).generate([target], SEEDED)[0].output_ids == alone


# ---- logprobs -------------------------------------------------------------------------------------------


def test_top_logprobs_validation():
    assert SamplingParams(top_logprobs=MAX_TOP_LOGPROBS).top_logprobs == 20
    with pytest.raises(ValidationError):
        convert({"top_logprobs": 21}, SamplingParams)
    with pytest.raises(ValidationError):
        convert({"top_logprobs": -1}, SamplingParams)


def test_logprobs_match_transformers(smol_runner, hf_smol, smol_tokenizer):
    prompt = smol_tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown")
    n = 8
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=5),
        SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=20, temperature=0.8, seed=3),
        SamplingParams(max_tokens=n, ignore_eos=True),
        SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True),
    ]
    engine = fresh_engine(smol_runner)
    results = engine.generate([prompt] * len(params), params)
    greedy, sampled, plain, chosen_only = results
    assert plain.logprobs == []
    assert chosen_only.output_ids == greedy.output_ids
    assert all(lp.top == [] for lp in chosen_only.logprobs)

    for res, top_n in ((greedy, 5), (sampled, 20), (chosen_only, 0)):
        ids = prompt + res.output_ids
        with torch.inference_mode():
            ref = hf_smol(torch.tensor([ids[:-1]])).logits[0, len(prompt) - 1 :].float().log_softmax(-1)
        assert len(res.logprobs) == n
        for i, (tok, lp) in enumerate(zip(res.output_ids, res.logprobs)):
            assert lp.logprob == pytest.approx(float(ref[i, tok]), abs=2e-3)
            assert len(lp.top) == top_n
            if not top_n:
                continue
            top_ids = [t for t, _ in lp.top]
            top_lps = [v for _, v in lp.top]
            assert top_lps == sorted(top_lps, reverse=True)
            assert len(set(top_ids)) == top_n
            ref_top = ref[i].topk(top_n)
            torch.testing.assert_close(torch.tensor(top_lps), ref_top.values, atol=2e-3, rtol=0)
            for t, v in lp.top:
                assert v == pytest.approx(float(ref[i, t]), abs=2e-3)
            assert lp.logprob <= top_lps[0] + 1e-6
            if tok in top_ids:
                assert dict(lp.top)[tok] == pytest.approx(lp.logprob, abs=1e-6)
        if res is greedy:  # greedy picks the top entry
            assert all(lp.top[0][0] == tok for tok, lp in zip(res.output_ids, res.logprobs))
    assert_pool_clean(engine)


# ---- stopping -------------------------------------------------------------------------------------------


def test_stop_token_ids_finish_with_stop(smol_runner, smol_tokenizer):
    prompt = smol_tokenizer.encode("The capital of France is")
    engine = fresh_engine(smol_runner)
    full = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_ids
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    res = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[full[k], -5]))[0]
    assert res.output_ids == full[: k + 1] and res.finish_reason == "stop"
    # A stop token on the very last allowed step still reports "stop"; a stop id never produced changes nothing.
    res = engine.generate([prompt], SamplingParams(max_tokens=k + 1, stop_token_ids=[full[k]]))[0]
    assert res.output_ids == full[: k + 1] and res.finish_reason == "stop"
    never = max(set(range(100)) - set(full))
    res = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[never]))[0]
    assert res.output_ids == full and res.finish_reason == "length"
    assert_pool_clean(engine)


def test_eos_respected_unless_ignore_eos(smol_runner, smol_tokenizer):
    eos = set(smol_runner.model_config.eos_token_ids)
    assert eos == {2}
    chat = smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    engine = fresh_engine(smol_runner)
    stopped = engine.generate([list(chat)], SamplingParams(max_tokens=30))[0]
    assert stopped.finish_reason == "stop" and stopped.output_ids[-1] in eos
    assert not eos & set(stopped.output_ids[:-1])
    n = len(stopped.output_ids)
    assert n < 30
    past = engine.generate([list(chat)], SamplingParams(max_tokens=n + 3, ignore_eos=True))[0]
    assert past.finish_reason == "length" and len(past.output_ids) == n + 3
    assert past.output_ids[:n] == stopped.output_ids
    assert_pool_clean(engine)


def test_grammar_on_the_real_model_ends_when_done_even_before_min_tokens(smol_runner, smol_tokenizer):
    from common.protocol import GrammarSpec

    chat = smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    engine = fresh_engine(smol_runner)
    choice = GrammarSpec(kind="ebnf", value='root ::= "yes" | "no"')
    params = [SamplingParams(max_tokens=10, grammar=choice, min_tokens=m, temperature=1.0, seed=m) for m in (0, 6)]
    free = SamplingParams(max_tokens=6, min_tokens=6)  # a neighbour without a grammar is held to its min_tokens
    results = engine.generate([list(chat)] * 3, [*params, free])
    for r in results[:2]:
        assert r.finish_reason == "stop" and smol_tokenizer.decode(r.output_ids[:-1]) in ("yes", "no")
        assert r.output_ids[-1] in smol_runner.model_config.eos_token_ids
    assert len(results[2].output_ids) == 6 and 2 not in results[2].output_ids
    assert_pool_clean(engine)


def test_grammar_masks_cover_the_tokenizer_and_ban_a_padded_heads_extra_ids(smol_path, smol_tokenizer):
    """A model whose LM head has rows past its tokenizer (Qwen2.5: 152,064 for 151,665 tokens): the masks cover
    the tokenizer's ids only (xgrammar fills each padded id as a token of its own), and a grammar row never
    samples a padded id, whatever its logit; a row without a grammar still may."""
    from common.protocol import GrammarSpec
    from common.sched.grammar import GrammarBook
    from common.sched.request import Req

    tok_vocab = len(smol_tokenizer.get_vocab())
    vocab = tok_vocab + 70
    book = GrammarBook(smol_path, vocab, [smol_tokenizer.eos_token_id])
    assert (book.mask_vocab, book.mask_words) == (tok_vocab, (tok_vocab + 31) // 32)
    grammar = SamplingParams(grammar=GrammarSpec(kind="ebnf", value='root ::= "yes" | "no"'))
    reqs = [Req(req_id=str(i), prompt_ids=[1, 2], sampling=p) for i, p in enumerate([grammar, SamplingParams()])]
    masks = book.fill(reqs)
    assert masks.bits.shape == (2, book.mask_words) and masks.rows == [0]
    logits = torch.zeros(2, vocab)
    logits[:, tok_vocab + 5] = 100.0  # a padded id the model favours
    sb = SamplingBatch.build([r.sampling for r in reqs], [0, 0], vocab, CPU, steps=[0, 0])
    sb.allowed_bits, sb.grammar_rows, sb.grammar_vocab = masks.bits, masks.rows, book.mask_vocab
    tokens = sample(logits, sb).tokens.tolist()
    text = smol_tokenizer.decode(tokens[:1])
    assert text and ("yes".startswith(text) or "no".startswith(text)) and tokens[1] == tok_vocab + 5
    # A stop id in the padding (a generation config may list one): a grammar that can only end still ends.
    book = GrammarBook(smol_path, vocab, [smol_tokenizer.eos_token_id, tok_vocab + 3])
    ends = SamplingParams(grammar=GrammarSpec(kind="ebnf", value='root ::= ""'))
    masks = book.fill([Req(req_id="end", prompt_ids=[1, 2], sampling=ends)])
    assert masks.rows == [0] and masks.done == [True]


# ---- grammars and penalties keep the overlap ---------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "mood": {"enum": ["happy", "sad"]}},
    "required": ["name", "mood"],
    "additionalProperties": False,
}


def test_grammars_and_penalties_keep_the_overlap_and_their_outputs(smol_runner, smol_tokenizer, monkeypatch):
    """Grammar rows, penalty rows and plain rows in one batch, greedy and seeded: overlap on (each forward
    launched before the step in flight is processed, only a grammar row's sampling waits for its mask) gives
    overlap off's tokens, which are each request's tokens decoded alone; grammar outputs are valid. With
    overlap on the waiting steps' masks are filled on their own thread, each while its step's forward is
    launched and the step before it processed, and a decode row's token is accepted by its matcher there too,
    in the fill's batch: the scheduler's thread feeds a matcher only a prompt's first token and a token that
    may end the request."""
    import json
    import threading

    from common.protocol import GrammarSpec
    from common.sched.scheduler import Scheduler
    from common.settings import SchedulerConfig

    person = GrammarSpec(kind="json_schema", value=json.dumps(PERSON))
    answer = GrammarSpec(kind="regex", value=r"(yes|no), because [a-z ]{3,12}\.")
    kinds = [
        dict(grammar=person),
        dict(),
        dict(grammar=person, temperature=0.9, seed=3, frequency_penalty=0.5),
        dict(frequency_penalty=0.7, presence_penalty=0.4),
        dict(grammar=answer, repetition_penalty=1.2),
        dict(repetition_penalty=1.3, temperature=0.8, seed=11, logprobs=True),
    ]
    texts = ["Describe a person as JSON.", "Is Paris in France? Answer yes or no and why."]
    chats = [
        list(
            smol_tokenizer.apply_chat_template(
                [{"role": "user", "content": texts[i % 2]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for i in range(len(kinds))
    ]
    params = [SamplingParams(max_tokens=20, **kw) for kw in kinds]
    alone = [fresh_engine(smol_runner).generate([c], sp)[0] for c, sp in zip(chats, params)]

    forward = smol_runner.forward
    in_flight: list[int] = []  # steps launched and not yet processed, at each forward
    for overlap in (False, True):
        engine = fresh_engine(smol_runner)
        cfg = SchedulerConfig(grammar_compile_timeout_s=TEST_GRAMMAR_COMPILE_TIMEOUT_S)
        sched = engine.scheduler = Scheduler(smol_runner, cfg, overlap=overlap)
        launched, processed = [0], [0]
        process = sched._process

        def counted_process(step, process=process, processed=processed):
            processed[0] += 1
            return process(step)

        def counted_forward(batch, launched=launched, processed=processed):
            in_flight.append(launched[0] - processed[0])
            launched[0] += 1
            return forward(batch)

        fill = sched.grammars.fill
        fills: list[tuple[str, int]] = []  # (thread, steps launched and not processed) at each mask fill

        def counted_fill(*a, fill=fill, fills=fills, launched=launched, processed=processed, **kw):
            fills.append((threading.current_thread().name, launched[0] - processed[0]))
            return fill(*a, **kw)

        advance = sched.grammars.advance
        main_feeds: list[int] = []  # output tokens fed to a matcher on the scheduler's thread

        def counted_advance(req, advance=advance, main_feeds=main_feeds):
            if threading.current_thread() is threading.main_thread():
                main_feeds.append(len(req.output_ids))
            return advance(req)

        monkeypatch.setattr(sched, "_process", counted_process)
        monkeypatch.setattr(sched.grammars, "fill", counted_fill)
        monkeypatch.setattr(sched.grammars, "advance", counted_advance)
        monkeypatch.setattr(smol_runner, "forward", counted_forward)
        in_flight.clear()
        results = engine.generate(chats, params)
        monkeypatch.setattr(smol_runner, "forward", forward)
        # Overlap on, a waiting step's masks fill on their own thread while its forward is on the device.
        threaded = [n for name, n in fills if name.startswith("kvferry-masks")]
        assert (len(threaded) > 10 and set(threaded) == {1}) if overlap else not threaded
        grammar_rows = [r for r, kw in zip(results, kinds) if "grammar" in kw]
        fed = sum(len(r.output_ids) for r in grammar_rows)
        if overlap:  # on this thread: the prompt's fill, the first token, the last (it ends the request)
            assert len(main_feeds) <= 3 * len(grammar_rows) < fed, main_feeds
        # (a rare run ended ([], "error"), under the full suite's load only: the rows that differ, and their errors,
        # say which part failed)
        assert [(r.output_ids, r.finish_reason) for r in results] == [(r.output_ids, r.finish_reason) for r in alone], [
            (i, overlap, r.output_ids, r.finish_reason, r.error, a.output_ids, a.finish_reason, a.error)
            for i, (r, a) in enumerate(zip(results, alone))
            if (r.output_ids, r.finish_reason) != (a.output_ids, a.finish_reason)
        ]
        assert [lp.logprob for lp in results[5].logprobs] == pytest.approx(
            [lp.logprob for lp in alone[5].logprobs], abs=1e-4
        )
        assert in_flight[1:] == [1 if overlap else 0] * (len(in_flight) - 1)
        assert_pool_clean(engine)
    for r, kw in zip(alone, kinds):
        text = smol_tokenizer.decode(r.output_ids, skip_special_tokens=True)
        if kw.get("grammar") is person and r.finish_reason == "stop":
            assert set(json.loads(text)) == {"name", "mood"}
        if kw.get("grammar") is answer and r.finish_reason == "stop":
            assert text.startswith(("yes, because ", "no, because ")) and text.endswith(".")
    assert sum(r.finish_reason == "stop" for r, kw in zip(alone, kinds) if "grammar" in kw) >= 2


STORY = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "story": {"type": "string", "minLength": 4000}},
    "required": ["title", "story"],
    "additionalProperties": False,
}


def test_a_step_sends_its_host_data_in_two_copies_whatever_the_batch(smol_runner, smol_tokenizer):
    """Grammar, penalty, seeded, logit_bias and min_tokens rows decoding together in the GPU's loop (overlap
    on): every step sends its host data to the device in at most two copies, one with the forward's inputs
    (the page table's writes in it) and one with sampling's (the grammar masks in it), and a steady decode
    step in exactly two, whether 2, 6 or 16 requests decode. Counted at every call that would cross to the device
    (tests/h2d_count.py), not timed."""
    import json

    from common.protocol import GrammarSpec
    from common.sched.request import Req
    from common.sched.scheduler import Scheduler
    from common.settings import SchedulerConfig
    from tests.h2d_count import count_host_to_device

    spec = GrammarSpec(kind="json_schema", value=json.dumps(STORY))
    chat = smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a story as JSON."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    kinds = [
        dict(grammar=spec, frequency_penalty=0.5),
        dict(repetition_penalty=1.2, presence_penalty=0.3, temperature=0.8),
        dict(logit_bias={5: -1.0}, min_tokens=20),
        dict(grammar=spec, temperature=0.7, repetition_penalty=1.1),
    ]
    per_decode_step = {}
    for n in (2, 6, 16):
        engine = fresh_engine(smol_runner)
        sched = engine.scheduler = Scheduler(
            smol_runner, SchedulerConfig(grammar_compile_timeout_s=TEST_GRAMMAR_COMPILE_TIMEOUT_S), overlap=True
        )
        for i in range(n):
            sp = SamplingParams(max_tokens=20, seed=i, **kinds[i % len(kinds)])
            sched.add(Req(req_id=f"c{i}", prompt_ids=list(chat), sampling=sp))
        decode_steps, sites = [], set()
        with count_host_to_device(smol_runner.device) as count:
            for _ in range(12):
                decoding = not sched.waiting and sched.chunked is None and len(sched.running) == n
                count.reset()
                sched.step()
                assert count.total <= 2, dict(count.sites)
                sites |= set(count.sites)
                if decoding:
                    decode_steps.append(count.total)
        assert len(decode_steps) >= 8 and all(r.finish_reason is None for r in sched.running)
        assert {s.split(":")[0] for s in sites} == {"common/engine/staging.py"}
        per_decode_step[n] = set(decode_steps[1:])  # the first may sample a prefill step at its launch
        sched.flush()
        for r in list(sched.running):
            sched.abort(r.req_id)
        assert_pool_clean(engine)
    assert per_decode_step == {2: {2}, 6: {2}, 16: {2}}


def test_a_token_outside_the_grammar_ends_the_request_there_in_both_loops(smol_runner, smol_tokenizer, monkeypatch):
    """A decode row's token is accepted by its matcher in the next mask fill (off the scheduler's thread with
    overlap on): a token its grammar does not allow (put into one step's sampled tokens, as a sampler fault
    would) still ends that request at that token with an error, overlap on and off alike, and its neighbours
    decode as they would alone."""
    from common.protocol import GrammarSpec
    from common.sched.scheduler import Scheduler
    from common.settings import SchedulerConfig

    answer = GrammarSpec(kind="regex", value=r"(yes|no), because [a-z ]{3,30}\.")
    chat = list(
        smol_tokenizer.apply_chat_template(
            [{"role": "user", "content": "Is Paris in France? Answer yes or no and why."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    params = [
        SamplingParams(max_tokens=16, grammar=answer),
        SamplingParams(max_tokens=16),
        SamplingParams(max_tokens=16, grammar=answer, temperature=0.9, seed=5),
    ]
    alone = [fresh_engine(smol_runner).generate([chat], sp)[0] for sp in params]
    bad = smol_tokenizer.encode("ZZZ", add_special_tokens=False)[0]  # no uppercase anywhere in the grammar
    at = 3  # the output index it lands at: a decode row's token
    assert all(len(r.output_ids) > at and r.finish_reason != "error" for r in alone), [
        (r.finish_reason, len(r.output_ids), r.text) for r in alone
    ]
    for overlap in (False, True):
        engine = fresh_engine(smol_runner)
        cfg = SchedulerConfig(grammar_compile_timeout_s=TEST_GRAMMAR_COMPILE_TIMEOUT_S)
        sched = engine.scheduler = Scheduler(smol_runner, cfg, overlap=overlap)
        process = sched._process

        @torch.inference_mode()
        def faulty_process(launched, process=process):
            for i, r in enumerate(launched.reqs[: launched.decode_rows]):
                if r.sampling is params[0] and len(r.output_ids) == at and not r.finished:
                    launched.tokens[i] = bad
            return process(launched)

        monkeypatch.setattr(sched, "_process", faulty_process)
        results = engine.generate([chat] * 3, params)
        broken = results[0]
        assert broken.output_ids == [*alone[0].output_ids[:at], bad], overlap
        assert broken.finish_reason == "error"
        assert [(r.output_ids, r.finish_reason) for r in results[1:]] == [
            (r.output_ids, r.finish_reason) for r in alone[1:]
        ]
        assert_pool_clean(engine)
