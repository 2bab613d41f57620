"""The engine on the real packaged SmolLM2 model, token-exact against transformers."""

from __future__ import annotations

import torch

from common.protocol import SamplingParams
from tests.engine_helpers import assert_pool_clean, fresh_engine, hf_greedy

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a dragon who loved to",
    "def fibonacci(n):",
    "List three colors of the rainbow:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "Translate to French: The quick brown fox",
]


def test_teacher_forced_logits_match_transformers(smol_runner, hf_smol, smol_tokenizer):
    engine = fresh_engine(smol_runner)
    ids = smol_tokenizer.encode(PROMPTS[4])
    ours = engine.score(ids)
    with torch.inference_mode():
        ref = hf_smol(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)
    assert_pool_clean(engine)


def test_greedy_batch_with_chunking_matches_transformers(smol_runner, hf_smol, smol_tokenizer):
    prompts = [smol_tokenizer.encode(p) for p in PROMPTS]
    longest = max(len(p) for p in prompts)
    budget = 16
    assert budget < longest  # the longest prompt is split over several chunks
    engine = fresh_engine(smol_runner, max_prefill_tokens=budget)
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    results = engine.generate(prompts, sp)
    for prompt, res in zip(prompts, results):
        assert res.output_ids == hf_greedy(hf_smol, prompt, 32), smol_tokenizer.decode(prompt)
        assert res.finish_reason == "length"
    assert_pool_clean(engine)


def test_shared_prefix_hits_radix_cache_and_stays_exact(smol_runner, hf_smol, smol_tokenizer):
    system = (
        "You are a helpful assistant who answers questions about geography, history and science "
        "with short, precise sentences. Always be polite. "
    )
    questions = ["What is the largest ocean?", "Who wrote Hamlet?", "Why is the sky blue?", "Name a prime number."]
    prompts = [smol_tokenizer.encode(system + q) for q in questions]
    engine = fresh_engine(smol_runner, max_prefill_tokens=64)
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    first = engine.generate(prompts[:1], sp)[0]
    assert first.cached_tokens == 0
    rest = engine.generate(prompts[1:], sp)
    shared = len(smol_tokenizer.encode(system)) // 16 * 16
    for prompt, res in zip(prompts[1:], rest):
        # Every page of the shared system prompt came from the cache.
        assert res.cached_tokens >= shared - 16, (res.cached_tokens, shared)
        assert res.output_ids == hf_greedy(hf_smol, prompt, 32)
    print(f"cached tokens per follow-up request: {[r.cached_tokens for r in rest]} of {[len(p) for p in prompts[1:]]}")
    assert first.output_ids == hf_greedy(hf_smol, prompts[0], 32)
    assert_pool_clean(engine)


def test_chat_answer(smol_runner, smol_tokenizer):
    engine = fresh_engine(smol_runner)
    ids = smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    res = engine.generate([list(ids)], SamplingParams(max_tokens=20))[0]
    assert smol_tokenizer.decode(res.output_ids, skip_special_tokens=True).strip() == "The capital of France is Paris."
    assert res.finish_reason == "stop"
    assert_pool_clean(engine)
