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
from tests.engine_helpers import assert_pool_clean
from tests.test_scheduler import PAGE, build_tiny_model, new_req, prompts

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tiny() -> DecoderModel:
    return build_tiny_model()


def scheduler(model: DecoderModel, num_pages: int, reservation: str, overlap: str = "off") -> Scheduler:
    runner = ModelRunner(RunnerConfig(page_size=PAGE, num_pages=num_pages, max_running=8, max_seq_len=512), model=model)
    cfg = SchedulerConfig(max_prefill_tokens=64, kv_reservation=reservation, overlap=overlap)
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


def test_a_duplicate_request_id_is_refused_and_changes_nothing(tiny: DecoderModel) -> None:
    sched = scheduler(tiny, 64, "full")
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
def test_random_interleavings_keep_the_table_and_the_page_ledger(tiny: DecoderModel, overlap: str) -> None:
    """A seeded mix of adds (prompts sharing prefixes), aborts and steps on a pool too small for the requests'
    whole outputs: optimistic reservation preempts. After every operation the table and the page ledger hold;
    every request ends once; the ones not aborted produce what they produce alone (with overlap on, the GPU
    loop's shape: a preempted request's token is still in flight when it is preempted)."""
    rng = random.Random(46)
    sched = scheduler(tiny, 24, "optimistic", overlap)
    bases = prompts(7, [48, 48])
    made: list[Req] = []
    aborted: set[str] = set()
    ended: dict[str, int] = {}
    for _ in range(400):
        op = rng.random()
        if op < 0.12 and len(made) < 24:
            base = bases[rng.randrange(2)]
            (tail,) = prompts(rng.randrange(10_000), [rng.randrange(1, 40)])
            r = new_req(base[: rng.randrange(8, 48)] + tail, max_tokens=rng.randrange(8, 90))
            sched.add(r)
            made.append(r)
        elif op < 0.16 and made:
            victim = rng.choice(made)
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
    assert ended == {r.req_id: 1 for r in made}  # every request ended, once
    assert not sched.by_id and sched.table_violations() == []
    cached = sched.cache.cached_pages if sched.cache is not None else 0
    assert sched.allocator.num_free + cached == sched.allocator.num_pages and sched.cache.protected_pages == 0
    kept = [r for r in made if r.req_id not in aborted]
    alone = run_alone(tiny, kept)
    assert {r.req_id: r.output_ids for r in kept} == alone
    assert all(r.finish_reason == "length" for r in kept)


def pool_bound_requests(tokenizer, ref_engine: Engine, n: int) -> list[tuple[list[int], SamplingParams]]:
    """`n` chat prompts asking max_tokens 400 whose output stops after 24-72 tokens: each stops at a token of its
    own unpreempted greedy output (a stop id that does not occur earlier), found from a reference run."""
    topics = ["the sea", "a small town", "bread", "winter", "trains", "a library", "the moon", "gardens"]
    ids = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Write a long story about {t}."}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for t in topics[:n]
    ]
    free = ref_engine.generate(ids, SamplingParams(max_tokens=80, ignore_eos=True))
    out = []
    for i, (prompt, res) in enumerate(zip(ids, free)):
        toks = res.output_ids
        want = 24 + (i * 13) % 48
        stop = next(j for j in range(want, len(toks)) if toks[j] not in toks[:j])
        out.append((prompt, SamplingParams(max_tokens=400, stop_token_ids=[toks[stop]], ignore_eos=True)))
    return out


def test_pool_bound_optimistic_admits_more_with_the_same_outputs(smol_path, smol_runner, smol_tokenizer) -> None:
    """A KV pool too small for max_tokens 400 per request, outputs that stop much earlier: full reservation
    runs a few at a time; optimistic admits more at once, preempts when the pool runs out, and every request
    gives the tokens it gives unpreempted, greedy and seeded; every page comes back."""
    ref = Engine(runner=smol_runner, sched_cfg=SchedulerConfig(), load_tokenizer=False)
    work = pool_bound_requests(smol_tokenizer, ref, 8)
    work[1] = (work[1][0], work[1][1].model_copy(update={"temperature": 0.8, "seed": 7, "max_tokens": 60}))
    ref_out = ref.generate([p for p, _ in work], [sp for _, sp in work])
    expected = [(r.output_ids, r.finish_reason) for r in ref_out]
    assert all(len(e) <= 80 for e, _ in expected)

    # 48 pages of 16 tokens: one request's prompt + max_tokens (28 pages) at a time under full reservation.
    runner = ModelRunner(RunnerConfig(model=str(smol_path), num_pages=48, max_running=16))
    peak: dict[str, int] = {}
    for policy in ("full", "optimistic"):
        engine = Engine(runner=runner, sched_cfg=SchedulerConfig(kv_reservation=policy), load_tokenizer=False)
        sched = engine.scheduler
        reqs = [Req(f"{policy}-{i}", list(p), sp) for i, (p, sp) in enumerate(work)]
        for r in reqs:
            sched.add(r)
        peak[policy] = 0
        while sched.has_work():
            sched.step()
            peak[policy] = max(peak[policy], sched.table.active_count())
            assert sched.table_violations() == []
        assert [(r.output_ids, r.finish_reason) for r in reqs] == expected, policy
        assert_pool_clean(engine)
        if policy == "optimistic":
            assert sched.table.preemptions > 0
    print(f"\npeak admitted: {peak}")
    assert peak["optimistic"] >= 2 * peak["full"]
