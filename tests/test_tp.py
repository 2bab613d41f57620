"""Tensor parallelism on the CPU (gloo): TP=2 answers exactly what TP=1 answers, in the engine and across
workers of different TP sizes, on the packaged SmolLM2 (9 query heads, 3 KV heads: split 2 + 1)."""

from __future__ import annotations

import os
import signal
import subprocess

import httpx
import pytest
import torch

from common.engine.named_configs import named_config
from common.engine.tp import TPShard
from common.offline import Engine
from common.protocol import SamplingParams
from common.settings import RunnerConfig, SchedulerConfig
from tests.helpers import wait_pages_back, wait_until
from tests.workers import generate, give_up_during_remote_prefill, run_concurrently, start_worker, wait_ready

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
CHUNK = 64  # KVFERRY_MAX_PREFILL_TOKENS of the test workers (tests/workers.py)


def test_shard_plan_covers_every_head_once() -> None:
    cfg = named_config("smollm2-135m")
    parts = [TPShard.plan(cfg, r, 2) for r in range(2)]
    assert [p.kv_heads for p in parts] == [(0, 2), (2, 3)]
    assert [p.q_heads for p in parts] == [(0, 6), (6, 9)]  # each rank keeps whole GQA groups
    assert parts[0].intermediate == (0, 768) and parts[1].intermediate == (768, 1536)
    # More ranks than KV heads: each KV head replicated, its query heads divided among the replicas.
    eight = [TPShard.plan(named_config("llama-3.1-8b"), r, 16) for r in range(16)]
    assert [p.kv_heads for p in eight[:4]] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert sorted({h for p in eight for h in range(*p.q_heads)}) == list(range(32))
    with pytest.raises(ValueError):
        TPShard.plan(cfg, 0, 4)  # 4 does not divide 3 KV heads


@pytest.fixture(scope="module")
def tp2_engine(smol_path):
    engine = Engine(
        RunnerConfig(model=str(smol_path), num_pages=256, tp_size=2), SchedulerConfig(max_prefill_tokens=16)
    )
    yield engine
    engine.runner.close()


def test_tp2_engine_matches_tp1(tp2_engine, smol_runner, smol_tokenizer) -> None:
    tp1 = Engine(runner=smol_runner, sched_cfg=SchedulerConfig(max_prefill_tokens=16))
    system = "You are a helpful assistant who answers in one sentence. " * 3
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        system + "What is the tallest mountain?",
        "Write a poem about the sea. " * 6,  # several 16-token chunks
    ]
    ids = [smol_tokenizer.encode(p) for p in prompts]
    want = tp1.generate(ids, GREEDY)
    got = tp2_engine.generate(ids, GREEDY)
    for w, g in zip(want, got):
        assert g.output_ids == w.output_ids
    # Radix hits: a second request sharing the system prompt reuses its pages on every rank.
    follow = smol_tokenizer.encode(system + "Which ocean is the largest?")
    again = tp2_engine.generate([follow], GREEDY)[0]
    assert again.cached_tokens >= 16
    assert again.output_ids == tp1.generate([follow], GREEDY)[0].output_ids
    # Teacher-forced logits agree to float32 summation-order noise.
    diff = (tp2_engine.score(ids[2]) - tp1.score(ids[2])).abs().max().item()
    assert diff < 2e-3
    sched = tp2_engine.scheduler
    assert sched.free_pages() == sched.allocator.num_pages  # every page free or held only by the prefix cache


def test_tp2_prompt_logprobs_match_tp1(tp2_engine, smol_runner, smol_tokenizer) -> None:
    """A scored prompt's rows reach the follower ranks too (their LM head shards join the same gather)."""
    tp1 = Engine(runner=smol_runner, sched_cfg=SchedulerConfig(max_prefill_tokens=16))
    ids = smol_tokenizer.encode("Write a poem about the sea. " * 6)  # several 16-token chunks
    asks = [SamplingParams(max_tokens=2, prompt_logprobs=3), SamplingParams(max_tokens=2)]
    want, got = tp1.generate([ids, ids[:9]], asks), tp2_engine.generate([ids, ids[:9]], asks)
    w, g = want[0].prompt_logprobs, got[0].prompt_logprobs
    assert w is not None and g is not None and len(g.logprobs) == len(ids) - 1
    assert max(abs(a - b) for a, b in zip(w.logprobs, g.logprobs)) < 2e-3
    # Ranks deep in the tail may move past near-ties at float32 noise; the likeliest ones may not.
    assert all(a == b if b <= 10 else abs(a - b) <= b // 100 + 1 for a, b in zip(g.ranks, w.ranks))
    assert g.top_ids == w.top_ids
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


def test_tp2_ranks_hold_their_heads_only(tp2_engine) -> None:
    pools = tp2_engine.runner.kv_rank_pools()
    assert [heads for _, heads in pools] == [(0, 2), (2, 3)]
    assert [p.layout.num_kv_heads for p, _ in pools] == [2, 1]
    assert pools[0][0].page_stride_bytes == 2 * pools[1][0].page_stride_bytes


@pytest.fixture(scope="module")
def tp_workers(redis_server):
    env = {"KVFERRY_DEBUG_CHECKSUMS": "1"}
    procs = {
        "prefill1": start_worker("prefill", redis_server, env=env),
        "prefill2": start_worker("prefill", redis_server, env={**env, "KVFERRY_TP_SIZE": "2"}),
        # The GPU arrangement for sending: each prefill follower posts its own heads from its own agent.
        "prefill2r": start_worker(
            "prefill", redis_server, env={**env, "KVFERRY_TP_SIZE": "2", "KVFERRY_TP_TRANSFER": "per-rank"}
        ),
        "decode2": start_worker("decode", redis_server, env={**env, "KVFERRY_TP_SIZE": "2"}),
        # The GPU arrangement on the CPU: each decode follower registers its own pool with its own NIXL agent.
        "decode2r": start_worker(
            "decode", redis_server, env={**env, "KVFERRY_TP_SIZE": "2", "KVFERRY_TP_TRANSFER": "per-rank"}
        ),
        "decode1": start_worker("decode", redis_server, env=env),
    }
    try:
        wait_ready(*procs.values())
        yield procs
    finally:
        for w in procs.values():
            w.stop()


def test_tp1_prefill_feeds_tp2_decode(tp_workers, smol_tokenizer) -> None:
    """Each decode rank receives only the KV heads it owns (rank 0: heads 0-1 packed, rank 1: head 2)."""
    p1, d2, d1 = tp_workers["prefill1"], tp_workers["decode2"], tp_workers["decode1"]
    texts = ["The capital of France is", "A story about a lighthouse keeper. " * 20]
    prompts = [smol_tokenizer.encode(t) for t in texts]
    assert max(len(x) for x in prompts) > 2 * CHUNK
    want = run_concurrently(lambda ids: generate(d1, ids, None), [(x,) for x in prompts])
    got = run_concurrently(lambda ids: generate(d2, ids, p1), [(x,) for x in prompts])
    for (wt, _), (gt, ev) in zip(want, got):
        assert gt == wt
        assert ev[0]["kv_verified"] is True  # page checksums over both decode ranks == prefill's
    wait_pages_back(p1, d2, d1)


def test_a_full_staging_area_puts_writes_off_instead_of_waiting(tp_workers, redis_server, smol_tokenizer) -> None:
    """A prefill worker whose staging area holds two one-page packed writes, and whose writes land late (the
    write-delay hook), feeds a TP=2 decode worker a prompt of many pages: the writes that find no room are put
    off to a later loop turn of its engine (counted), not waited for, and the KV arrives whole. A write put off
    is tried again only once staging space came back, not every loop turn (the loop waits meanwhile): so the
    count stays within two per page, where a loop polling each turn counts hundreds over the writes' delay."""
    d2, d1 = tp_workers["decode2"], tp_workers["decode1"]
    env = {"KVFERRY_DEBUG_CHECKSUMS": "1", "KVFERRY_TRANSFER_STAGING_MB": "2", "KVFERRY_FAULT_WRITE_DELAY_S": "0.2"}
    p = start_worker("prefill", redis_server, env=env)
    try:
        wait_ready(p)
        ids = smol_tokenizer.encode("A story about a harbor pilot. " * 12)
        want, _ = generate(d1, ids, None)
        got, events = generate(d2, ids, p)
        assert got == want and events[0]["kv_verified"] is True
        deferred = httpx.get(f"{p.url}/internal/stats", timeout=5).json()["transfer"]["posts_deferred"]
        pages = -(-len(ids) // 16)
        assert 0 < deferred <= 2 * pages, (deferred, pages)
        wait_pages_back(p, d2)
    finally:
        p.stop()


def test_tp1_prefill_feeds_decode_ranks_with_their_own_agents(tp_workers, smol_tokenizer) -> None:
    """Per-rank agents (the GPU path): one NIXL request per decode rank agent, then one notification."""
    p1, d2r, d1 = tp_workers["prefill1"], tp_workers["decode2r"], tp_workers["decode1"]
    prompts = [smol_tokenizer.encode(t) for t in ("Why is the sky blue?", "A recipe for bread. " * 20)]
    want = run_concurrently(lambda ids: generate(d1, ids, None), [(x,) for x in prompts])
    got = run_concurrently(lambda ids: generate(d2r, ids, p1), [(x,) for x in prompts])
    for (wt, _), (gt, ev) in zip(want, got):
        assert gt == wt
        assert ev[0]["kv_verified"] is True
    wait_pages_back(p1, d2r, d1)


@pytest.mark.parametrize("decode", ["decode2", "decode2r"])
def test_prefill_ranks_with_their_own_agents_post_their_own_heads(tp_workers, smol_tokenizer, decode) -> None:
    """TP=2 prefill whose follower posts its own KV head (the GPU path) into a TP=2 decode worker, whether the
    decode ranks share one agent or run their own: the same text as a local prefill, every page checksum equal
    on both sides, every page back."""
    p2r, d2, d1 = tp_workers["prefill2r"], tp_workers[decode], tp_workers["decode1"]
    texts = ["The capital of France is", "A story about a lighthouse keeper. " * 20, "def fibonacci(n):"]
    prompts = [smol_tokenizer.encode(t) for t in texts]
    assert max(len(x) for x in prompts) > 2 * CHUNK  # several chunks, each posted by both ranks
    want = run_concurrently(lambda ids: generate(d1, ids, None), [(x,) for x in prompts])
    got = run_concurrently(lambda ids: generate(d2, ids, p2r), [(x,) for x in prompts])
    for (wt, _), (gt, ev) in zip(want, got):
        assert gt == wt
        assert ev[0]["kv_verified"] is True  # page checksums over both decode ranks == both prefill ranks'
    wait_pages_back(p2r, d2, d1)


def test_abort_while_prefill_ranks_post_their_own_heads_returns_pages(tp_workers, smol_tokenizer) -> None:
    """Giving up mid-prefill aborts both prefill ranks' writes; the pages come back on every worker once every
    rank's writes settled."""
    p2r, d2r, d1 = tp_workers["prefill2r"], tp_workers["decode2r"], tp_workers["decode1"]
    ids = smol_tokenizer.encode("An extremely long document about rivers and mountains. " * 120)
    give_up_during_remote_prefill(d2r, p2r, ids)
    wait_pages_back(p2r, d2r, d1)
    # Still serving afterwards, the same text as a local prefill.
    short = smol_tokenizer.encode("Why is the sky blue?")
    assert generate(d2r, short, p2r)[0] == generate(d1, short, None)[0]


def test_tp2_prefill_feeds_tp2_decode_with_radix_hits(tp_workers, smol_tokenizer) -> None:
    p2, d2, d1 = tp_workers["prefill2"], tp_workers["decode2"], tp_workers["decode1"]
    system = "You answer questions about trains, briefly. " * 6
    first = smol_tokenizer.encode(system + "When is the first train?")
    second = smol_tokenizer.encode(system + "Is there a dining car?")
    for ids in (first, second):
        want, _ = generate(d1, ids, None)
        got, ev = generate(d2, ids, p2)
        assert got == want and ev[0]["kv_verified"] is True
    assert ev[0]["cached_tokens"] >= len(smol_tokenizer.encode(system)) // 16 * 16 - 16 > 0
    # A TP=2 decode worker also prefills locally (both ranks compute).
    assert generate(d2, second, None)[0] == want
    wait_pages_back(p2, d2, d1)


def test_tp2_prefill_to_tp1_decode_is_refused(tp_workers, smol_tokenizer) -> None:
    """Decode rank 0 of a TP=1 worker holds all 3 heads, spread over both prefill ranks: refused clearly."""
    p2, d1 = tp_workers["prefill2"], tp_workers["decode1"]
    tokens, events = generate(d1, smol_tokenizer.encode("Hello there"), p2)
    assert tokens == [] and events[-1]["finish_reason"] == "error"
    assert "tensor-parallel size" in events[-1]["error"]
    wait_pages_back(p2, d1)
    # The refused pair does not disturb anything else.
    assert generate(d1, smol_tokenizer.encode("Hello there"), tp_workers["prefill1"])[0]


def test_tp_logits_match_at_rank_boundaries(tp2_engine, smol_runner, smol_tokenizer) -> None:
    """Vocab-parallel LM head: tokens on both sides of the vocab split (24576) score the same as TP=1."""
    tp1 = Engine(runner=smol_runner)
    ids = smol_tokenizer.encode("Numbers: 1, 2, 3, and the word antidisestablishmentarianism.")
    a, b = tp1.score(ids), tp2_engine.score(ids)
    half = a.shape[1] // 2
    assert torch.allclose(a[:, half - 8 : half + 8], b[:, half - 8 : half + 8], atol=2e-3)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize(
    "config_cls,extra",
    [
        # One KV head over two ranks: replicated, its 4 query heads split 2 + 2.
        ("LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=False, num_key_value_heads=1)),
        # q/k/v biases sliced with their heads; tied embeddings through the vocab-parallel head.
        ("Qwen2Config", dict(num_hidden_layers=2, tie_word_embeddings=True)),
        # Every expert's intermediate dim split 40 + 40 (the router whole on both ranks); layer 1 dense, split too.
        (
            "Qwen3MoeConfig",
            dict(
                num_hidden_layers=2,
                tie_word_embeddings=False,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=80,
                norm_topk_prob=True,
                mlp_only_layers=[1],
            ),
        ),
    ],
    ids=["llama-replicated-kv", "qwen2-bias-tied", "qwen3-moe-experts-split"],
)
def test_tp2_random_checkpoints_match_transformers(config_cls, extra, tmp_path) -> None:
    from tests.test_engine_random_models import _build_hf, _check_greedy, _random_prompts

    hf = _build_hf(config_cls, extra, seed=1234)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    engine = Engine(
        RunnerConfig(model=str(tmp_path), num_pages=128, max_running=8, max_seq_len=512, tp_size=2),
        SchedulerConfig(max_prefill_tokens=16),
        load_tokenizer=False,
    )
    try:
        shards = [TPShard.plan(engine.runner.model.full_cfg, r, 2) for r in range(2)]
        if "num_experts" in extra:
            assert [s.moe_intermediate for s in shards] == [(0, 40), (40, 80)]
        if extra.get("num_key_value_heads") == 1:
            assert [s.kv_heads for s in shards] == [(0, 1), (0, 1)] and [s.q_heads for s in shards] == [(0, 2), (2, 4)]
        prompts = _random_prompts(3, [5, 40, 70])
        results = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        _check_greedy(hf, prompts, results)
    finally:
        engine.runner.close()


def test_lost_rank_fails_requests_and_the_worker_heals(redis_server, smol_tokenizer) -> None:
    """A follower that dies leaves an engine that cannot compute: its requests fail with an error, and the
    worker starts its engine (every rank) again by itself and serves (docs/reliability.md, Engine restart)."""
    d = start_worker("decode", redis_server, env={"KVFERRY_TP_SIZE": "2"})
    try:
        wait_ready(d)
        ids = smol_tokenizer.encode("Hello there")
        before = generate(d, ids, None)[0]
        assert before
        found = subprocess.run(["pgrep", "-s", str(d.proc.pid), "-f", "tp_follower"], capture_output=True)
        followers = [int(p) for p in found.stdout.split()]
        assert len(followers) == 1
        os.kill(followers[0], signal.SIGKILL)
        tokens, events = generate(d, ids, None, timeout=60)
        assert tokens == [] and events[-1]["finish_reason"] == "error"
        error = events[-1]["error"]  # whichever the worker reports first: the lost rank or its engine's exit
        assert "tensor-parallel rank" in error or "engine process exited" in error, error

        def serving_again() -> list[int]:
            if httpx.get(f"{d.url}/ready", timeout=5).status_code != 200:
                return []
            return generate(d, ids, None, timeout=60)[0]

        healed = wait_until(serving_again, 60, "the worker serving again after losing a rank", interval=0.5)
        assert healed == before  # greedy: the same text from the new engine
        found = subprocess.run(["pgrep", "-s", str(d.proc.pid), "-f", "tp_follower"], capture_output=True)
        assert [int(p) for p in found.stdout.split()] not in ([], followers)  # a new follower rank
        metrics = httpx.get(f"{d.url}/metrics", timeout=5).text
        assert "kvferry_engine_restarts_total 1.0" in metrics
        assert d.proc.poll() is None  # the control plane never exited
    finally:
        d.kill9()


def test_step_message_round_trip() -> None:
    """What rank 0 publishes is what followers rebuild, journal included (the big-step path sizes its
    payload from the same header)."""
    from common.engine.forward_batch import StepInputs
    from common.engine.tp_ranks import HEADER_LEN, decode_step, encode_step, payload_parts

    inputs = StepInputs(
        False,
        torch.tensor([5, 6, 7, 8]),
        torch.tensor([3, 1]),
        torch.tensor([0, 9]),
        torch.tensor([2, 4]),
        torch.tensor([True, False]),
        all_logits=True,
    )
    journal = [(2, 0, torch.tensor([7, 8])), (4, 1, torch.tensor([3]))]
    for score_lens in (None, torch.tensor([2, 0])):  # prompt logprobs: the scored rows travel too
        inputs.score_lens = score_lens
        message = torch.from_numpy(encode_step(inputs, journal))
        header, payload = message[:HEADER_LEN], message[HEADER_LEN:]
        assert sum(payload_parts(header)) == payload.numel()
        got = decode_step(header, payload)
        for name in ("input_ids", "extend_lens", "starts", "table_rows", "sample_mask"):
            assert torch.equal(getattr(got.inputs, name), getattr(inputs, name)), name
        assert (got.inputs.is_decode, got.inputs.all_logits) == (False, True)
        assert (got.inputs.score_lens is None) == (score_lens is None)
        if score_lens is not None:
            assert got.inputs.score_lens.tolist() == [2, 0]
        assert [(r, f, p.tolist()) for r, f, p in got.journal] == [(2, 0, [7, 8]), (4, 1, [3])]
