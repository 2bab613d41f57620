"""The scheduler's bookkeeping: aborts, KV-memory admission, length limits, continuous batching.

Runs on a tiny random model (dummy weights) so hundreds of steps take seconds; every test drives
`Scheduler.step()` by hand and checks the page/row ledger after each step.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from common.engine.model import DecoderModel
from common.engine.model_config import ModelConfig, RopeConfig
from common.engine.runner import ModelRunner, RunnerConfig
from common.engine.weights import init_dummy_weights
from common.offline import Engine
from common.protocol import SamplingParams
from common.sched.kv_connector import KVConnector
from common.sched.request import Req, ReqState
from common.sched.scheduler import RequestRejected, Scheduler, SchedulerConfig
from tests.engine_helpers import assert_pool_clean

VOCAB = 512
PAGE = 16


def build_tiny_model() -> DecoderModel:
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position=1024,
        rope=RopeConfig(theta=10000.0),
        eos_token_ids=(VOCAB - 1,),
        name="tiny",
    )
    model = DecoderModel(cfg, torch.float32, torch.device("cpu"))
    init_dummy_weights(model, seed=3)
    assert model.lm_head is not None
    model.lm_head.data *= 4  # spread the logits: greedy near-ties would make output comparisons fragile
    return model


def make_engine(
    model: DecoderModel,
    num_pages: int = 256,
    max_running: int = 8,
    max_seq_len: int = 512,
    max_prefill_tokens: int = 64,
    prefix_cache: bool = True,
    itl_target_ms: float | None = None,
) -> Engine:
    runner = ModelRunner(
        RunnerConfig(page_size=PAGE, num_pages=num_pages, max_running=max_running, max_seq_len=max_seq_len),
        model=model,
    )
    sched_cfg = SchedulerConfig(max_prefill_tokens=max_prefill_tokens, enable_prefix_cache=prefix_cache)
    if itl_target_ms is not None:
        sched_cfg.itl_target_ms = itl_target_ms
    return Engine(runner=runner, sched_cfg=sched_cfg, load_tokenizer=False)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Never the EOS id (VOCAB - 1), so prompts read the same whatever ignore_eos says.
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in lengths]


def new_req(prompt: list[int], max_tokens: int = 8, **kw) -> Req:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    return Req(req_id=uuid.uuid4().hex, prompt_ids=list(prompt), sampling=sp)


class ChunkLog(KVConnector):
    """A connector that only records each prompt chunk's (request id, start, end) once its KV is computed."""

    transfers = True

    def __init__(self) -> None:
        self.chunks: list[tuple[str, int, int]] = []

    def chunk_done(self, req: Req, start: int, end: int) -> None:
        self.chunks.append((req.req_id, start, end))


def check_invariants(sched: Scheduler) -> None:
    """Every page is free, in the prefix cache, or owned by exactly one active request; every table row is
    free or held by exactly one active request; each request's table row points at its own pages."""
    active = list(sched.running) + list(sched.awaiting_kv.values())
    if sched.chunked is not None:
        active.append(sched.chunked)
    assert len({id(r) for r in active}) == len(active)
    ps = sched.page_size
    own: list[int] = []
    for r in active:
        r.check()
        assert r.state in (ReqState.PREFILLING, ReqState.RUNNING, ReqState.AWAITING_KV)
        assert r.device_len == r.prompt_len + len(r.output_ids)
        assert 0 <= r.tree_pages <= len(r.pages)
        assert len(r.pages) * ps >= r.cached_len
        assert len(r.pages) <= sched.budget.pages_for(r.max_device_len)
        assert r.table_row >= 0
        row = sched.runner.page_table.table[r.table_row, : len(r.pages) * ps].view(-1, ps).to(torch.int64)
        assert row[:, 0].div(ps, rounding_mode="floor").tolist() == r.pages
        assert bool((row - row[:, :1] == torch.arange(ps)).all())
        own.extend(r.pages[r.tree_pages :])
    assert len({r.table_row for r in active}) == len(active)
    assert sched.runner.page_table.num_free_rows + len(active) == sched.max_running
    assert len(set(own)) == len(own)
    if own:
        assert not bool(sched.allocator.is_free(torch.tensor(own)).any())
    cached = sched.cache.cached_pages if sched.cache is not None else 0
    assert sched.allocator.num_free + cached + len(own) == sched.allocator.num_pages
    assert sched.reserved_pages() <= sched.budget.available_pages()
    assert len(sched.running) <= sched.max_running
    for r in sched.waiting:
        assert r.state is ReqState.WAITING and r.table_row == -1 and r.pages == [] and r.output_ids == []
    assert sched.table_violations() == []


def drain(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_work():
        sched.step()
        check_invariants(sched)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def reference_outputs(model: DecoderModel, prompt_list: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Each prompt alone on a roomy engine."""
    engine = make_engine(model, num_pages=256)
    return [
        engine.generate([p], SamplingParams(max_tokens=n, ignore_eos=True))[0].output_ids
        for p, n in zip(prompt_list, max_tokens)
    ]


# ---- request ledger ---------------------------------------------------------------------------------------


def test_req_length_invariant_is_asserted():
    r = new_req([1, 2, 3], max_tokens=4)
    assert (r.cached_len, r.device_len, r.max_device_len) == (0, 3, 7)
    r.check()
    for cached, device in ((4, 3), (-1, 3), (0, 8)):
        r.cached_len, r.device_len = cached, device
        with pytest.raises(AssertionError, match="lengths out of order"):
            r.check()
    r.cached_len, r.device_len = 7, 7
    r.check()


# ---- abort ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["waiting", "queued-behind-full-batch", "chunked-prefill", "running", "cache-hit"])
def test_abort_at_every_stage_frees_everything(tiny_model, stage):
    engine = make_engine(tiny_model, max_running=3, max_prefill_tokens=32)
    sched = engine.scheduler
    shared, *others = prompts(1, [64, 20, 9, 30])
    bystanders = [new_req(p, max_tokens=12) for p in others[:2]]

    if stage == "cache-hit":  # a finished request leaves its prompt in the cache; the victim then locks it
        first = new_req(shared, max_tokens=4)
        sched.add(first)
        drain(sched)
        assert sched.cache.cached_pages >= 4
    for r in bystanders:
        sched.add(r)

    if stage == "waiting":
        victim = new_req(others[2], max_tokens=12)
        sched.add(victim)
    elif stage == "queued-behind-full-batch":
        sched.add(filler := new_req(others[2], max_tokens=40))
        victim = new_req(others[2], max_tokens=12)
        sched.add(victim)
        for _ in range(3):
            sched.step()
            check_invariants(sched)
        assert len(sched.running) == 3 and victim.state is ReqState.WAITING
        assert filler.state is ReqState.RUNNING
    else:
        tail = prompts(2, [60])[0]
        victim = new_req(shared + tail if stage == "cache-hit" else tail + shared, max_tokens=12)
        sched.add(victim)
        while victim.state is ReqState.WAITING or victim is not sched.chunked:
            sched.step()
            check_invariants(sched)
            if stage == "running" and victim.state is ReqState.RUNNING:
                break
        if stage == "running":
            while len(victim.output_ids) < 3:
                sched.step()
                check_invariants(sched)
            assert victim in sched.running
        else:
            assert victim is sched.chunked and victim.state is ReqState.PREFILLING
            assert victim.pages and victim.table_row >= 0
            assert 0 < victim.cached_len < victim.prompt_len
            if stage == "cache-hit":
                assert victim.prefix_hit_len >= 48 and victim.tree_pages >= 3
                assert sched.cache.protected_pages >= 3

    event = sched.abort(victim.req_id)
    assert event is not None and event.finished and event.req is victim
    assert victim.finished and victim.finish_reason == "abort"
    assert victim.table_row == -1 and victim.pages == [] and victim.cache_node is None
    assert victim.req_id not in sched.by_id and victim not in sched.running and victim not in sched.waiting
    assert sched.chunked is not victim
    check_invariants(sched)
    assert sched.abort(victim.req_id) is None  # twice: a no-op
    assert sched.abort("no-such-request") is None
    produced = len(victim.output_ids)

    drain(sched)
    assert len(victim.output_ids) == produced  # nothing more after the abort
    for r in bystanders:
        assert r.finish_reason == "length" and len(r.output_ids) == 12
    assert_pool_clean(engine)


# ---- KV-memory budget ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_tiny_pool_queues_requests_and_completes_them_all(tiny_model, prefix_cache):
    num_pages = 10  # 160 token slots
    engine = make_engine(tiny_model, num_pages=num_pages, max_running=8, prefix_cache=prefix_cache)
    sched = engine.scheduler
    # Six requests of 4 pages each (prompt 40 + 24 outputs) and one needing the whole pool (150 + 10 = 160).
    lengths, max_tokens = [40, 40, 150, 40, 40, 40, 40], [24, 24, 10, 24, 24, 24, 24]
    plist = prompts(5, lengths)
    reqs = [new_req(p, n) for p, n in zip(plist, max_tokens)]
    for r in reqs:
        sched.add(r)
    most_active, queued_while_busy, steps = 0, False, 0
    while sched.has_work():
        sched.step()  # never raises "KV pool exhausted": admission reserves prompt + max_tokens up front
        check_invariants(sched)
        active = len(sched.running) + (sched.chunked is not None)
        most_active = max(most_active, active)
        queued_while_busy |= bool(sched.waiting) and active > 0
        steps += 1
        assert steps < 2000
    assert most_active == 2  # two 4-page requests fit in 10 pages, never three
    assert queued_while_busy
    for r, n in zip(reqs, max_tokens):
        assert r.finish_reason == "length" and len(r.output_ids) == n
    assert_pool_clean(engine)
    # Queueing changes when a request runs, not what it produces.
    assert [r.output_ids for r in reqs] == reference_outputs(tiny_model, plist, max_tokens)


def test_request_that_can_never_fit_is_rejected(tiny_model):
    engine = make_engine(tiny_model, num_pages=10)
    sched = engine.scheduler
    too_big = new_req(prompts(6, [150])[0], max_tokens=11)  # 161 tokens: 11 pages of a 10-page pool
    with pytest.raises(RequestRejected, match="KV pages"):
        sched.add(too_big)
    with pytest.raises(RequestRejected):
        engine.generate([too_big.prompt_ids], SamplingParams(max_tokens=11))
    with pytest.raises(RequestRejected):
        engine.score(prompts(6, [161])[0])
    assert too_big.req_id not in sched.by_id and not sched.has_work()
    assert_pool_clean(engine)
    # Exactly the pool's size is fine.
    res = engine.generate([too_big.prompt_ids], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(res.output_ids) == 10
    assert_pool_clean(engine)


def test_prompt_plus_max_tokens_beyond_context_rejected(tiny_model):
    engine = make_engine(tiny_model, num_pages=64, max_seq_len=256)
    sched = engine.scheduler
    prompt = prompts(7, [200])[0]
    with pytest.raises(RequestRejected, match="context length of 256"):
        sched.add(new_req(prompt, max_tokens=57))
    with pytest.raises(RequestRejected, match="context length"):
        engine.score(prompts(7, [257])[0])
    with pytest.raises(RequestRejected, match="vocabulary"):
        sched.add(new_req([1, 2, VOCAB], max_tokens=2))
    with pytest.raises(RequestRejected, match="vocabulary"):
        sched.add(new_req([-1, 2], max_tokens=2))
    dup = new_req([1, 2, 3], max_tokens=2)
    sched.add(dup)
    with pytest.raises(RequestRejected, match="duplicate"):
        sched.add(Req(req_id=dup.req_id, prompt_ids=[4], sampling=SamplingParams()))
    assert sched.abort(dup.req_id) is not None
    assert not sched.has_work()
    # Up to the context exactly: runs, and stops there.
    res = engine.generate([prompt], SamplingParams(max_tokens=56, ignore_eos=True))[0]
    assert len(res.output_ids) == 56 and res.finish_reason == "length"
    assert_pool_clean(engine)


# ---- many requests ------------------------------------------------------------------------------------------


def test_many_requests_small_max_running(tiny_model):
    gen = torch.Generator().manual_seed(8)
    n = 40
    lengths = torch.randint(1, 41, (n,), generator=gen).tolist()
    max_tokens = torch.randint(1, 21, (n,), generator=gen).tolist()
    plist = prompts(9, lengths)
    prefix = prompts(10, [32])[0]
    plist = [prefix + p if i % 2 else p for i, p in enumerate(plist)]  # half share a two-page prefix
    engine = make_engine(tiny_model, num_pages=64, max_running=4, max_prefill_tokens=48)
    sched = engine.scheduler
    reqs = [new_req(p, m) for p, m in zip(plist, max_tokens)]
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_work():
        sched.step()
        check_invariants(sched)
        assert len(sched.running) + (sched.chunked is not None) <= 4
        steps += 1
        assert steps < 5000
    for r, m in zip(reqs, max_tokens):
        assert r.finished and r.finish_reason == "length" and len(r.output_ids) == m
    assert sum(r.prefix_hit_len > 0 for r in reqs) >= 10
    assert_pool_clean(engine)
    assert [r.output_ids for r in reqs] == reference_outputs(tiny_model, plist, max_tokens)


def test_max_tokens_one_finishes_at_prefill(tiny_model):
    engine = make_engine(tiny_model)
    res = engine.generate(prompts(11, [5, 33]), SamplingParams(max_tokens=1, ignore_eos=True))
    assert [len(r.output_ids) for r in res] == [1, 1] and {r.finish_reason for r in res} == {"length"}
    assert not engine.scheduler.has_work()
    assert_pool_clean(engine)


def test_prefill_budget_below_a_page_is_refused(tiny_model):
    # Chunks end on page boundaries, so a budget under one page could never admit a longer prompt (it used to
    # leave such a request waiting forever).
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        make_engine(tiny_model, max_prefill_tokens=PAGE - 1)
    engine = make_engine(tiny_model, max_prefill_tokens=PAGE)  # one page per step works, if slowly
    res = engine.generate(prompts(13, [50]), SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(res.output_ids) == 3
    assert_pool_clean(engine)


# ---- continuous batching ------------------------------------------------------------------------------------


def test_prefill_first_runs_a_new_prompt_before_decoding(tiny_model):
    """ITL target 0 (prefill-first, the A/B baseline): a prompt that arrives while others decode takes whole
    steps of its own until its first token; then it decodes in the same batch."""
    engine = make_engine(tiny_model, max_prefill_tokens=64, itl_target_ms=0)
    sched = engine.scheduler
    pa, pb, pc = prompts(12, [10, 25, 90])
    a, b = new_req(pa, max_tokens=20), new_req(pb, max_tokens=20)
    sched.add(a)
    sched.add(b)
    events = sched.step()  # one prefill step for both
    assert {e.req.req_id for e in events} == {a.req_id, b.req_id}
    assert sched.running == [a, b]
    for _ in range(3):  # decode steps
        events = sched.step()
        assert [e.req for e in events] == [a, b] and all(len(e.tokens) == 1 for e in events)
    assert len(a.output_ids) == len(b.output_ids) == 4

    c = new_req(pc, max_tokens=20)  # 90-token prompt, 64-token budget: two prefill chunks
    sched.add(c)
    assert c.state is ReqState.WAITING
    events = sched.step()
    assert events == [] and sched.chunked is c and c.cached_len == 64  # first chunk, no token yet
    assert len(a.output_ids) == 4
    events = sched.step()
    assert [e.req for e in events] == [c] and len(c.output_ids) == 1  # prompt done: first token
    assert sched.running == [a, b, c]
    events = sched.step()
    assert [e.req for e in events] == [a, b, c]  # c decodes in the same batch as a and b from now on
    drain(sched)
    assert_pool_clean(engine)
    assert [a.output_ids, b.output_ids, c.output_ids] == reference_outputs(tiny_model, [pa, pb, pc], [20, 20, 20])


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_overlap_on_equals_overlap_off(tiny_model: DecoderModel, prefix_cache: bool) -> None:
    """The loop the GPU runs (overlap on: step N+1 launched before step N's tokens are read, next inputs taken
    from the device) gives the CPU loop's tokens, logprobs and finish reasons, with stop tokens, seeded
    sampling, penalties (repetition too), chunked prefill and an abort mid-stream in the mix; every page comes
    back."""
    ps = prompts(11, [5, 40, 90, 17, 130, 33, 64, 8])
    greedy = reference_outputs(tiny_model, [ps[3]], [12])[0]
    stops = {3: [greedy[4]]}  # request 3 stops early, on a token the device sampled
    kinds = [
        dict(),
        dict(temperature=0.9, seed=5),
        dict(logprobs=True, top_logprobs=3, repetition_penalty=1.3),
        dict(),
        dict(frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=1.1, top_k=20, seed=1),
        dict(),
        dict(min_p=0.05, temperature=0.8, seed=4),
    ]
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_model, max_prefill_tokens=48, prefix_cache=prefix_cache)
        cfg = SchedulerConfig(max_prefill_tokens=48, enable_prefix_cache=prefix_cache)
        sched = engine.scheduler = Scheduler(engine.runner, cfg, overlap=overlap)
        assert sched.overlap is overlap
        reqs = []
        for i, (p, kw) in enumerate(zip(ps, kinds)):
            sp = SamplingParams(max_tokens=12 + i, ignore_eos=True, stop_token_ids=stops.get(i, []), **kw)
            r = Req(req_id=f"r{i}", prompt_ids=list(p), sampling=sp)
            reqs.append(r)
            sched.add(r)
        steps = 0
        while sched.has_work():
            sched.step()
            steps += 1
            if steps == 6:
                sched.abort("r6")
            check_invariants(sched)
        results[overlap] = [
            (r.output_ids, r.finish_reason, [round(lp.logprob, 4) for lp in r.output_logprobs]) for r in reqs
        ]
        assert results[overlap][3][1] == "stop"
        assert_pool_clean(engine)
    assert results[True] == results[False]


def test_penalty_counts_on_the_device_follow_each_requests_history(tiny_model: DecoderModel) -> None:
    """The history and counts the sampler reads are kept on the device, per table row: at every step (overlap
    on, a token in flight) a penalty request's row holds its prompt, output and tokens in flight, and its
    output's counts plus its tokens in flight, however rows are reused (3 rows, 7 requests) and with earlier
    output from another worker (`output_offset`). Outputs equal each request decoded alone."""
    from common.engine.sampling import token_counts

    ps = prompts(31, [20, 9, 40, 17, 33, 12, 26])
    kinds = [
        dict(frequency_penalty=0.8, presence_penalty=0.4),
        dict(),
        dict(repetition_penalty=1.5, temperature=0.9, seed=3),
        dict(frequency_penalty=1.2, output_offset=5),
        dict(presence_penalty=-0.7, repetition_penalty=1.2),
        dict(temperature=1.0, seed=8),
        dict(repetition_penalty=1.3, frequency_penalty=0.2, output_offset=3, temperature=0.7, seed=2),
    ]
    params = [SamplingParams(max_tokens=10 + 2 * i, ignore_eos=True, **kw) for i, kw in enumerate(kinds)]
    alone = [make_engine(tiny_model).generate([p], sp)[0].output_ids for p, sp in zip(ps, params)]

    engine = make_engine(tiny_model, max_running=3)
    sched = engine.scheduler = Scheduler(engine.runner, SchedulerConfig(max_prefill_tokens=64), overlap=True)
    reqs = [Req(req_id=f"p{i}", prompt_ids=list(p), sampling=sp) for i, (p, sp) in enumerate(zip(ps, params))]
    for r in reqs:
        sched.add(r)
    checked = 0
    while sched.has_work():
        sched.step()
        check_invariants(sched)
        for r in sched.running:
            if not (r.sampling.frequency_penalty or r.sampling.presence_penalty or r.sampling.repetition_penalty != 1):
                continue
            cut = r.prompt_len - r.sampling.output_offset
            host = token_counts([r.prompt_ids[cut:] + r.output_ids], VOCAB)[0]
            penalties = sched.sampler.penalties
            extra = penalties.counts[r.table_row] - host
            assert bool((extra >= 0).all()) and int(extra.sum()) == sched.inflight(r)
            # The history: prompt, output, the tokens in flight, then the first id repeated.
            known = r.prompt_ids + r.output_ids
            history = penalties.ids[r.table_row]
            assert history[: len(known)].tolist() == known
            assert bool((history[len(known) + sched.inflight(r) :] == known[0]).all())
            checked += 1
    assert checked > 40
    assert [r.output_ids for r in reqs] == alone
    assert_pool_clean(engine)


def _fitted_model(base=0.004, per_token=25e-6, per_row=20e-6, per_ctx=5e-8, per_pair=0.0, noise=0.0, seed=0):
    """A step-time model fitted to steps whose times follow the given costs (with Gaussian noise)."""
    import random

    from common.sched.step_model import StepShape, StepTimeModel, chunk_attention

    rng = random.Random(seed)
    model = StepTimeModel()
    for _ in range(300):
        rows = rng.randrange(0, 200)
        ctx = rows * rng.randrange(100, 3000)
        tokens = rng.choice([0, 0, rng.randrange(16, 2048)])
        start = rng.randrange(0, 4096) if tokens else 0
        pairs = chunk_attention(start, tokens)
        t = base + per_token * tokens + per_row * rows + per_ctx * ctx + per_pair * pairs
        model.observe(StepShape(tokens, rows, ctx, pairs), max(1e-5, t + rng.gauss(0, noise)))
    return model


def test_step_model_recovers_the_costs_of_what_a_step_computes() -> None:
    from common.sched.step_model import StepShape, chunk_attention

    model = _fitted_model(per_pair=2e-9)
    coef = model.coefficients()
    assert coef["base_s"] == pytest.approx(0.004, rel=1e-3)
    assert coef["per_prefill_token_s"] == pytest.approx(25e-6, rel=1e-3)
    assert coef["per_decode_row_s"] == pytest.approx(20e-6, rel=1e-3)
    assert coef["per_context_token_s"] == pytest.approx(5e-8, rel=1e-3)
    assert coef["per_attention_pair_s"] == pytest.approx(2e-9, rel=1e-3)
    shape = StepShape(512, 64, 64 * 1000, chunk_attention(2048, 512))
    want = 0.004 + 25e-6 * 512 + 20e-6 * 64 + 5e-8 * 64_000 + 2e-9 * chunk_attention(2048, 512)
    assert model.predict(shape) == pytest.approx(want, rel=1e-3)
    assert model.spread_s < 1e-6


def test_step_model_keeps_the_prompt_cost_through_a_decode_only_spell_longer_than_its_window() -> None:
    """A drain or a quiet spell of decode-only steps longer than the window leaves no prompt step in it: the model
    keeps the last prompt steps it timed, so the first chunk after the spell is priced as before it (an H100
    trace: forgotten, a 2,048-token step was predicted at 5.8 ms and took 43 ms)."""
    from common.sched.step_model import PROMPT_KEEP, WINDOW, StepShape

    model = _fitted_model()
    chunk = StepShape(2048, 8, 8 * 2000, 0.0)
    before = model.predict(chunk)
    for i in range(3 * WINDOW):  # decode only, 16-64 rows
        rows = 16 + i % 48
        model.observe(StepShape(0, rows, rows * 2000), 0.004 + 20e-6 * rows + 5e-8 * rows * 2000)
    assert model.ready and model.predict(chunk) == pytest.approx(before, rel=0.02)
    assert model.coefficients()["per_prefill_token_s"] == pytest.approx(25e-6, rel=0.02)
    # with the window full of prompt steps again, nothing older is kept: the fit follows the new speed alone
    for i in range(WINDOW):
        tokens = 256 + (i * 37) % 1792
        model.observe(StepShape(tokens, 8, 8 * 2000), 0.004 + 50e-6 * tokens + 20e-6 * 8 + 5e-8 * 16_000)
    assert model.coefficients()["per_prefill_token_s"] == pytest.approx(50e-6, rel=0.02)
    assert PROMPT_KEEP < WINDOW


def test_step_model_costs_are_never_negative() -> None:
    """Steps whose time does not depend on a feature (or falls with it, noise) give that feature no cost: a
    negative cost would promise an unbounded chunk."""
    model = _fitted_model(per_ctx=0.0, noise=2e-4, seed=3)
    assert all(v >= 0 for k, v in model.coefficients().items() if k != "base_s")


def test_budget_is_the_largest_chunk_whose_predicted_step_fits_the_target() -> None:
    from common.sched.prefill_budget import MIN_PAGES, StepContext, prefill_token_budget
    from common.sched.step_model import StepTimeModel

    model = _fitted_model()
    ctx = StepContext(decode_rows=64, decode_context=64_000, chunk_start=0)
    # 50 ms - (4 ms + 1.28 ms rows + 3.2 ms context) = 41.52 ms of chunk at 25 us/token: 1660 tokens, whole pages
    got = prefill_token_budget(2048, 16, 0.050, True, model, ctx)
    assert got == int(0.04152 / 25e-6) // 16 * 16
    assert prefill_token_budget(2048, 16, 0.050, False, model, ctx) == 2048  # alone: the whole budget
    assert prefill_token_budget(2048, 16, 0.0, True, model, ctx) == 2048  # no target (prefill-first)
    assert prefill_token_budget(512, 16, 0.050, True, model, ctx) == 512  # never above max_prefill_tokens
    assert prefill_token_budget(2048, 16, 0.005, True, model, ctx) == MIN_PAGES * 16  # no room: the floor
    # Deeper in a long prompt a chunk attends over more: the budget shrinks with the chunk's start.
    deep = _fitted_model(per_pair=2e-9)
    shallow = prefill_token_budget(2048, 16, 0.050, True, deep, ctx)
    assert prefill_token_budget(2048, 16, 0.050, True, deep, StepContext(64, 64_000, 6000)) < shallow
    # A margin of residual spreads: noisier steps, smaller chunks.
    noisy = _fitted_model(noise=2e-3, seed=5)
    assert prefill_token_budget(2048, 16, 0.050, True, noisy, ctx, margin_z=2.33) < got
    # Before any chunk was timed: the measured prefill speed over the target less the decode step.
    fresh = StepTimeModel()
    assert prefill_token_budget(2048, 16, 0.02, True, fresh, ctx, prefill_tokens_per_s=40_000.0) == 800
    assert prefill_token_budget(2048, 16, 0.02, True, fresh, ctx, 0.0, 40_000.0, 0.005) == 592
    assert prefill_token_budget(2048, 16, 0.02, True, fresh, ctx) == 2048  # nothing measured: the whole budget
    # No step longer than max_step_s, alone or beside decoding: 20 ms at 25 us/token = 800 tokens.
    assert prefill_token_budget(2048, 16, 0.050, False, model, ctx, max_step_s=0.024) == 800 - 800 % 16
    assert prefill_token_budget(2048, 16, 0.0, True, model, ctx, max_step_s=0.024) == 800  # prefill-first too
    assert prefill_token_budget(2048, 16, 0.050, True, model, ctx, max_step_s=1.0) == got  # the target is tighter
    assert prefill_token_budget(2048, 16, 0.0, False, fresh, ctx, 0.0, 1000.0, max_step_s=0.5) == 496
    # A fitted model is bounded by the measured speed: no chunk is priced below the decode step plus its tokens at
    # the fastest prefill seen alone (here 20k tokens/s: (50 - 10) ms -> 800 tokens, where the fit allows 1,660).
    assert prefill_token_budget(2048, 16, 0.050, True, model, ctx, 0.0, 20_000.0, 0.010) == 800
    assert prefill_token_budget(2048, 16, 0.050, True, model, ctx, 0.0, 400_000.0, 0.010) == got  # the fit binds


def test_slo_classes_parse_and_map_priorities() -> None:
    from common.slo import DEFAULT_SLO_SPEC, parse_slo_classes

    slo = parse_slo_classes(DEFAULT_SLO_SPEC)
    assert slo.names == ("interactive", "batch") and slo.default == "interactive"
    assert slo.get("").name == "interactive" and slo.get("batch").ttft_s is None
    assert slo.get("interactive").ttft_s == 1.0 and slo.get("interactive").itl_s == 0.05
    assert parse_slo_classes(slo.spec()) == slo  # the canonical form reads back the same
    # vLLM's priority: lower is sooner, 0 the default class; clamped to the declared classes.
    assert [slo.by_priority(p).name for p in (-5, 0, 1, 7)] == ["interactive", "interactive", "batch", "batch"]
    three = parse_slo_classes("gold:ttft=200ms,itl=20;silver:ttft=2s,itl=100ms;bronze:itl=1s", default="silver")
    assert [three.by_priority(p).name for p in (-1, 0, 1)] == ["gold", "silver", "bronze"]
    # A class without a TTFT target queues behind the others for ten of the tightest target, then goes first.
    assert three.queue_deadline(three.get("bronze"), 100.0) == pytest.approx(102.0)
    for bad in ("", "a:ttft=1s", "a:itl=0", "a:itl=5,b:itl=6;a:itl=7", "a:itl=5,p=120", "a b:itl=5", "a:itl=5,x=1"):
        with pytest.raises(ValueError):
            parse_slo_classes(bad)
    with pytest.raises(ValueError, match="unknown SLO class 'gold'"):
        slo.get("gold")


def test_waiting_prompts_are_served_by_deadline_and_batch_is_not_starved() -> None:
    from common.protocol import SamplingParams
    from common.sched.request import Req
    from common.sched.waiting import WaitingQueue

    def req(name: str, deadline: float, rank: int) -> Req:
        r = Req(name, [1, 2, 3], SamplingParams())
        r.deadline_s, r.slo_rank = deadline, rank
        return r

    q = WaitingQueue()
    # A batch request that arrived at t=0 (patience 10 s) and interactive ones arriving later (1 s targets).
    for r in (req("batch-0", 10.0, 1), req("chat-1", 2.0, 0), req("chat-2", 3.0, 0), req("chat-3", 10.0, 0)):
        q.append(r)
    assert [r.req_id for r in q] == ["chat-1", "chat-2", "chat-3", "batch-0"]  # a tie goes to the higher class
    q.append(req("chat-late", 11.5, 0))  # arrived after the batch request's patience ran out: it waits
    assert [r.req_id for r in q][-2:] == ["batch-0", "chat-late"]
    q.remove(q[1])
    assert q.popleft().req_id == "chat-1" and len(q) == 3


def test_itl_target_chunks_prefill_beside_decoding_and_keeps_outputs(tiny_model: DecoderModel) -> None:
    """With an ITL target a prompt that arrives while another request decodes is prefilled in capped chunks
    (the tiny model's measured speed puts the cap at the 4-page floor), and every output is unchanged."""
    long_prompt, short_prompt = prompts(21, [300, 20])
    outputs, chunk_lens = {}, {}
    for target in (0.0, 0.1):
        engine = make_engine(tiny_model, max_prefill_tokens=512)
        cfg = SchedulerConfig(max_prefill_tokens=512, itl_target_ms=target)
        chunks = ChunkLog()
        sched = engine.scheduler = Scheduler(engine.runner, cfg, connector=chunks)
        first = new_req(short_prompt, max_tokens=40)
        first.req_id = "short"
        sched.add(first)
        for _ in range(4):  # the short request prefills (the speed is measured) and starts decoding
            sched.step()
        assert sched.running and sched.pacing.prefill_speed.tokens_per_s > 0
        second = new_req(long_prompt, max_tokens=8)
        second.req_id = "long"
        sched.add(second)
        drain(sched)
        outputs[target] = (first.output_ids, second.output_ids)
        chunk_lens[target] = [e - s for rid, s, e in chunks.chunks if rid == "long"]
    assert outputs[0.1] == outputs[0.0]
    assert chunk_lens[0.0] == [300]  # one step without a target
    assert max(chunk_lens[0.1]) <= 4 * PAGE and sum(chunk_lens[0.1]) == 300


def test_warm_up_runs_every_step_kind_and_leaves_nothing_behind(tiny_model: DecoderModel) -> None:
    """The start-up warm-up (common/sched/warm_up.py) runs prefill-only, decode and mixed steps through the
    runner, then gives every page and table row back: a scheduler built after it serves the same tokens."""
    from common.sched.warm_up import warm_up

    engine = make_engine(tiny_model, num_pages=256, max_running=8, max_prefill_tokens=64)
    runner = engine.runner
    rows = runner.page_table.num_free_rows
    report = warm_up(runner, SchedulerConfig(max_prefill_tokens=64), fullest=True)
    assert {"prefill", "decode", "mixed"} <= set(report.kinds), report.kinds
    # its last phase fills every slot beside the prompt: the largest eager tensors a GPU's allocator will serve
    assert report.widest_mixed_rows == 8
    assert report.prefill_tokens_per_s > 0  # its full-size prompt alone, timed: the serving budget starts there
    serving = Scheduler(runner, SchedulerConfig(max_prefill_tokens=64))
    serving.seed_prefill_speed(report.prefill_tokens_per_s)
    assert serving.pacing.prefill_speed.peak_tokens_per_s == report.prefill_tokens_per_s
    assert runner.page_table.num_free_rows == rows
    prompt_list = prompts(11, [40, 70])
    got = [r.output_ids for r in engine.generate(prompt_list, SamplingParams(max_tokens=6, ignore_eos=True))]
    assert got == reference_outputs(tiny_model, prompt_list, [6, 6])


def test_warm_up_phases_end_with_every_slot_on_a_gpu() -> None:
    from common.sched.warm_up import warm_up_batches

    assert warm_up_batches(256) == [1, 3, 8, 20]
    assert warm_up_batches(256, fullest=True) == [1, 3, 8, 20, 255]
    assert warm_up_batches(21, fullest=True) == [1, 3, 8, 20]  # already the fullest
    assert warm_up_batches(3) == [1] and warm_up_batches(2, fullest=True) == [1]
    assert warm_up_batches(1, fullest=True) == []


def test_warm_up_fits_a_small_engine(tiny_model: DecoderModel) -> None:
    """A short context and a small pool get a smaller warm-up, never a refused request that stops the worker (nor
    a setting its throwaway scheduler cannot honour: it has no host tier to park preempted requests in)."""
    from common.sched.warm_up import warm_up

    engine = make_engine(tiny_model, num_pages=24, max_running=4, max_seq_len=48, max_prefill_tokens=32)
    rows = engine.runner.page_table.num_free_rows
    report = warm_up(engine.runner, SchedulerConfig(max_prefill_tokens=32, host_kv_gb=1, preempt_mode="park"))
    assert report.steps > 0 and "decode" in report.kinds
    assert engine.runner.page_table.num_free_rows == rows
