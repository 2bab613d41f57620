"""The memory policy (KVFERRY_KV_RESERVATION, common/sched/pages.py) and the request table's ledger.

Optimistic reservation admits requests on their prompt and a small decode allowance; when the pool runs out a
running request is preempted (its pages freed, recomputed later with its outputs so far). Users must see the
same tokens as without preemption, every request must finish, and every page must come back. The table and the
page ledger are checked after every operation of a seeded random mix of adds, aborts and steps.
"""

from __future__ import annotations

import random

import pytest

from common.engine.model import DecoderModel
from common.engine.runner import ModelRunner, RunnerConfig
from common.offline import Engine
from common.protocol import SamplingParams
from common.sched.request import Req, ReqState
from common.sched.request_table import DuplicateRequest
from common.sched.scheduler import Scheduler, SchedulerConfig
from tests.engine_helpers import assert_pool_clean, story_prompts
from tests.test_scheduler import PAGE, new_req, prompts

pytestmark = pytest.mark.timeout(600)


def scheduler(
    model: DecoderModel, num_pages: int, reservation: str, overlap: str = "off", host_pages: int = 0
) -> Scheduler:
    """`host_pages` > 0: a host KV tier of that many pages, where preempted requests park (KVFERRY_PREEMPT_MODE)."""
    runner = ModelRunner(RunnerConfig(page_size=PAGE, num_pages=num_pages, max_running=8, max_seq_len=512), model=model)
    # Half a page over: the tier's size in pages is rounded down from its bytes.
    gb = (host_pages + 0.5) * runner.pool.page_stride_bytes / (1 << 30) if host_pages else 0
    cfg = SchedulerConfig(max_prefill_tokens=64, kv_reservation=reservation, overlap=overlap, host_kv_gb=gb)
    cfg.preempt_mode = "park" if host_pages else "auto"
    return Scheduler(runner, cfg)


def run_alone(model: DecoderModel, reqs: list[Req]) -> dict[str, list[int]]:
    """Each request's output on a pool that never runs short (full reservation, nothing preempted)."""
    sched = scheduler(model, 512, "full")
    copies = {r.req_id: Req(r.req_id, list(r.prompt_ids), r.sampling, seed=r.seed) for r in reqs}
    for c in copies.values():
        sched.add(c)
    while sched.has_work():
        sched.step()
    assert sched.table.preemptions == 0
    return {rid: c.output_ids for rid, c in copies.items()}


def test_a_duplicate_request_id_is_refused_and_changes_nothing(tiny_model: DecoderModel) -> None:
    sched = scheduler(tiny_model, 64, "full")
    (prompt,) = prompts(5, [40])
    first = new_req(prompt, max_tokens=4)
    sched.add(first)
    sched.step()
    twin = Req(first.req_id, list(prompt), SamplingParams(max_tokens=4))
    with pytest.raises(DuplicateRequest):
        sched.add(twin)
    assert sched.by_id[first.req_id] is first and twin.state is ReqState.WAITING and twin.pages == []
    assert sched.table_violations() == []
    while sched.has_work():
        sched.step()
    assert first.finish_reason == "length" and len(first.output_ids) == 4
    assert sched.table_violations() == [] and not sched.by_id


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("host_pages", [0, 40], ids=["recompute", "park"])
def test_random_interleavings_keep_the_table_and_the_page_ledger(
    tiny_model: DecoderModel, overlap: str, host_pages: int
) -> None:
    """A seeded mix of adds (prompts sharing prefixes), aborts and steps on a pool too small for the requests'
    whole outputs: optimistic reservation preempts, recomputing or (with a host tier) parking, some of them
    aborted while parked. After every operation the table and the page ledger (device and host pages) hold;
    every request ends once; the ones not aborted produce what they produce alone, greedy and seeded (with
    overlap on, the GPU loop's shape: a preempted request's token is still in flight when it is preempted)."""
    rng = random.Random(46)
    sched = scheduler(tiny_model, 16 if host_pages else 24, "optimistic", overlap, host_pages)
    aborted_parked = 0
    bases = prompts(7, [48, 48])
    made: list[Req] = []
    aborted: set[str] = set()
    ended: dict[str, int] = {}
    for _ in range(400):
        op = rng.random()
        if op < 0.12 and len(made) < 24:
            base = bases[rng.randrange(2)]
            (tail,) = prompts(rng.randrange(10_000), [rng.randrange(1, 40)])
            seeded = {"temperature": 0.9, "seed": rng.randrange(1000)} if rng.random() < 0.3 else {}
            r = new_req(base[: rng.randrange(8, 48)] + tail, max_tokens=rng.randrange(8, 90), **seeded)
            sched.add(r)
            made.append(r)
        elif op < 0.16 and made:
            parked = [r for r in made if r.parked is not None]
            victim = rng.choice(parked if parked and rng.random() < 0.5 else made)
            aborted_parked += victim.parked is not None
            if sched.abort(victim.req_id) is not None:
                aborted.add(victim.req_id)
                ended[victim.req_id] = ended.get(victim.req_id, 0) + 1
        else:
            for e in sched.step():
                if e.finished:
                    ended[e.req.req_id] = ended.get(e.req.req_id, 0) + 1
        assert sched.table_violations() == []
    while sched.has_work():
        for e in sched.step():
            if e.finished:
                ended[e.req.req_id] = ended.get(e.req.req_id, 0) + 1
        assert sched.table_violations() == []
    assert sched.table.preemptions > 0, "the pool never ran short: the test exercises nothing"
    if host_pages:
        assert sched.table.parked > 0 and aborted_parked > 0, (sched.table.parked, aborted_parked)
        host = sched.cache.host
        assert host.allocator.num_free + sched.cache.host_cached_pages == host.num_pages
    else:
        assert sched.table.parked == 0
    print(f"\npreemptions {sched.table.preemptions}, parked {sched.table.parked}, aborted parked {aborted_parked}")
    assert ended == {r.req_id: 1 for r in made}  # every request ended, once
    assert not sched.by_id and sched.table_violations() == []
    cached = sched.cache.cached_pages if sched.cache is not None else 0
    assert sched.allocator.num_free + cached == sched.allocator.num_pages and sched.cache.protected_pages == 0
    kept = [r for r in made if r.req_id not in aborted]
    alone = run_alone(tiny_model, kept)
    assert {r.req_id: r.output_ids for r in kept} == alone
    assert all(r.finish_reason == "length" for r in kept)


def pool_bound_work(tokenizer, ref_engine: Engine, n: int) -> list[tuple[list[int], SamplingParams, list[int]]]:
    """`n` chat prompts asking max_tokens 300 whose output stops after 8-32 tokens, with that output: each stops
    at a token of its own greedy output (one that does not occur earlier), found by a run without a stop."""
    topics = ["the sea", "a small town", "bread", "winter", "trains", "a library", "the moon", "gardens"]
    ids = story_prompts(tokenizer, topics[:n])
    free = ref_engine.generate(ids, SamplingParams(max_tokens=40, ignore_eos=True))
    out = []
    for i, (prompt, res) in enumerate(zip(ids, free)):
        toks = res.output_ids
        want = 8 + (i * 7) % 24
        stop = min((j for j in range(4, len(toks)) if toks[j] not in toks[:j]), key=lambda j: abs(j - want))
        sp = SamplingParams(max_tokens=300, stop_token_ids=[toks[stop]], ignore_eos=True)
        out.append((prompt, sp, toks[: stop + 1]))
    return out


def test_pool_bound_optimistic_admits_more_with_the_same_outputs(smol_path, smol_runner, smol_tokenizer) -> None:
    """A KV pool too small for more than one request's max_tokens, outputs that stop much earlier: full
    reservation runs one at a time; optimistic admits several (preempting if the pool runs out: the random-mix test
    asserts preemptions and their outputs), every request gives the tokens it gives unpreempted, every
    page comes back. (Full reservation's outputs are the
    reference run's own policy; it is run here only until its first request ends, for its concurrency.)"""
    ref = Engine(runner=smol_runner, sched_cfg=SchedulerConfig(), load_tokenizer=False)
    work = pool_bound_work(smol_tokenizer, ref, 6)
    # 24 pages of 16 tokens: one request's prompt + max_tokens (22 pages) at a time under full reservation.
    runner = ModelRunner(RunnerConfig(model=str(smol_path), num_pages=24, max_running=16))
    peak: dict[str, int] = {}
    for policy in ("optimistic", "full"):
        engine = Engine(runner=runner, sched_cfg=SchedulerConfig(kv_reservation=policy), load_tokenizer=False)
        sched = engine.scheduler
        reqs = [Req(f"{policy}-{i}", list(p), sp) for i, (p, sp, _) in enumerate(work)]
        for r in reqs:
            sched.add(r)
        peak[policy] = 0
        while sched.has_work() and (policy == "optimistic" or not any(r.finished for r in reqs)):
            sched.step()
            peak[policy] = max(peak[policy], sched.table.active_count())
            assert sched.table_violations() == []
        if policy == "full":
            for r in reqs:
                sched.abort(r.req_id)
            assert_pool_clean(engine)
            continue
        assert [r.output_ids for r in reqs] == [want for _, _, want in work]
        assert all(r.finish_reason == "stop" for r in reqs)
        assert_pool_clean(engine)
        preempted = sched.table.preemptions
    print(f"\npeak admitted: {peak}, preemptions: {preempted}")
    assert peak["optimistic"] >= 2 * peak["full"]


def test_load_publishes_what_a_request_reserves_and_the_router_counts_the_same(tiny_model: DecoderModel) -> None:
    """/load's free pages are the pages not used nor promised: under optimistic reservation a request is
    promised its prompt and the allowance, and /load says so; the router's KV admission then counts a request
    as the worker will, prompt + allowance, not prompt + max_tokens."""
    from router.decision.admission import RequestKV, kv_room
    from router.decision.load import parse_load
    from router.decision.pool import WorkerPool

    frees = {}
    for policy in ("full", "optimistic"):
        sched = scheduler(tiny_model, 64, policy)
        (prompt,) = prompts(9, [40])
        sched.add(new_req(prompt, max_tokens=400))
        sched.step()  # admitted: 3 prompt pages, plus the reservation
        snap = sched.snapshot()
        frees[policy] = snap.free_pages
        allowance = snap.kv_reserve_output_tokens
        assert allowance == (0 if policy == "full" else 2 * PAGE)
    assert frees == {"full": 64 - 28, "optimistic": 64 - 5}  # 440 tokens: 28 pages; 40 + 32: 5

    pool = WorkerPool(client=None)  # type: ignore[arg-type]
    pool.set_targets("decode", ["http://d0"])
    w = pool.workers["http://d0"]
    snap = {"role": "decode", "pod": "d0", "running_requests": 0, "waiting_requests": 0, "free_pages": 40}
    snap |= {"total_pages": 64, "page_size": 16, "ready": True, "max_running": 8}
    need = RequestKV(40 + 1000, 40 + 1000, 1000)  # prompt 40, max_tokens 1000: 1040 tokens > 40 pages' 640
    pool.report_load(w, parse_load(snap))
    assert not kv_room(w, need)
    pool.report_load(w, parse_load(snap | {"kv_reserve_output_tokens": 32}))
    assert kv_room(w, need) and need.on(w.load).call_tokens == 72
