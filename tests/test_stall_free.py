"""Stall-free batching: every step decodes every running request beside prompt chunks (mixed steps).

Same tokens as prefill-first scheduling (ITL target 0) for every kind of request, with the page ledger
checked after every step; counted, never timed: while a prompt prefills, every step advances every running
request, and waiting prompts progress every step even when the ITL target leaves them no room.
"""

from __future__ import annotations

import pytest

from common.engine.model import DecoderModel
from common.protocol import SamplingParams
from common.sched.kv_connector import FinishedTransfers, KVConnector
from common.sched.prefill_budget import FLOOR_DECODE_STEPS, MIN_PAGES, StepContext
from common.sched.request import Req
from common.sched.scheduler import Scheduler, SchedulerConfig
from common.settings_registry import ITL_TARGET_AUTO, ITL_TARGET_SLO
from tests.engine_helpers import assert_pool_clean
from tests.test_scheduler import PAGE, ChunkLog, check_invariants, make_engine, prompts

# A target far below any step: the budget beside decoding is its floor, so chunks are small and many.
TINY_TARGET_MS = 1e-3


def scheduler(
    model: DecoderModel,
    itl_target_ms: float,
    overlap: bool,
    prefix_cache: bool = True,
    connector: KVConnector | None = None,
    **kw,
) -> Scheduler:
    max_prefill = kw.pop("max_prefill_tokens", 256)
    engine = make_engine(model, max_prefill_tokens=max_prefill, prefix_cache=prefix_cache, **kw)
    cfg = SchedulerConfig(max_prefill_tokens=max_prefill, enable_prefix_cache=prefix_cache, itl_target_ms=itl_target_ms)
    engine.scheduler = Scheduler(engine.runner, cfg, overlap=overlap, connector=connector)
    return engine.scheduler


KINDS = [
    dict(),
    dict(temperature=0.9, seed=5),
    dict(logprobs=True, top_logprobs=3),
    dict(frequency_penalty=0.5, presence_penalty=0.3),
    dict(temperature=1.1, top_k=20, seed=1),
    dict(repetition_penalty=1.3),
    dict(min_p=0.05, temperature=0.8, seed=4),
    dict(),
]


def run_workload(sched: Scheduler, abort_after: int = 3) -> tuple[list[tuple], list[Req], int]:
    """Eight requests decode while more arrive: a long chunked prompt, prompts sharing its prefix (prefix-cache
    hits), short ones; one request is aborted once it has `abort_after` tokens, while its next step is in
    flight. Returns each request's (outputs, finish reason, logprobs), the requests, and the mixed steps run."""
    ps = prompts(31, [5, 40, 90, 17, 130, 33, 64, 8, 300, 12, 20])
    shared = ps[8][:160]
    late = [ps[8], shared + ps[9], shared + ps[10], ps[9]]
    reqs = []
    for i, p in enumerate(ps[:8] + late):
        sp = SamplingParams(max_tokens=10 + i, ignore_eos=True, **KINDS[i % len(KINDS)])
        reqs.append(Req(req_id=f"r{i}", prompt_ids=list(p), sampling=sp))
    for r in reqs[:8]:
        sched.add(r)
    steps = mixed = 0
    aborted = False
    while sched.has_work():
        if steps == 3:
            sched.add(reqs[8])  # the long prompt: several chunks beside decoding
        if steps == 5:
            for r in reqs[9:]:
                sched.add(r)
        sched.step()
        mixed += sched.processed_kind == "mixed"
        steps += 1
        if not aborted and len(reqs[2].output_ids) >= abort_after:
            sched.abort("r2")  # with overlap on its next step is on the device now
            aborted = True
        check_invariants(sched)
    out = [(r.output_ids, r.finish_reason, [lp.logprob for lp in r.output_logprobs]) for r in reqs]
    return out, reqs, mixed


def assert_same_outputs(got: list[tuple], want: list[tuple]) -> None:
    """Tokens and finish reasons exactly; logprobs to float32 rounding (a row's logits come from a forward of
    another shape under mixed steps: their last bits may differ, and one rounded to 4 decimals then did)."""
    assert [(tokens, reason) for tokens, reason, _ in got] == [(tokens, reason) for tokens, reason, _ in want]
    for (_, _, lps), (_, _, expected) in zip(got, want):
        assert lps == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_mixed_steps_give_prefill_first_tokens(tiny_model: DecoderModel, overlap: bool, prefix_cache: bool) -> None:
    """Greedy, seeded sampling, penalties, logprobs, chunked prompts, prefix-cache hits and an abort: the same
    outputs under mixed steps (small chunks, the auto target) as under prefill-first; every page comes back."""
    results = {}
    for target in (0.0, TINY_TARGET_MS, ITL_TARGET_AUTO):
        sched = scheduler(tiny_model, target, overlap, prefix_cache)
        out, reqs, mixed = run_workload(sched)
        assert (mixed > 0) == (target != 0), (target, mixed)
        assert reqs[2].finish_reason == "abort"
        if prefix_cache:
            assert reqs[9].prefix_hit_len >= 160 - PAGE and reqs[10].prefix_hit_len >= 160 - PAGE
        cached = sched.cache.cached_pages if sched.cache is not None else 0
        assert sched.allocator.num_free + cached == sched.allocator.num_pages
        assert sched.runner.page_table.num_free_rows == sched.max_running
        results[target] = out
    assert_same_outputs(results[TINY_TARGET_MS], results[0.0])
    assert_same_outputs(results[ITL_TARGET_AUTO], results[0.0])


@pytest.mark.parametrize("overlap", [False, True])
def test_every_step_advances_every_running_request_while_a_prompt_prefills(
    tiny_model: DecoderModel, overlap: bool
) -> None:
    """A 300-token prompt arrives while three requests decode: it is prefilled in floor-sized chunks (MIN_PAGES
    pages), and every one of those steps also gives each running request its next token."""
    log = ChunkLog()
    sched = scheduler(tiny_model, TINY_TARGET_MS, overlap, connector=log)
    running = [
        Req(req_id=f"d{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=60, ignore_eos=True))
        for i, p in enumerate(prompts(41, [12, 30, 7]))
    ]
    for r in running:
        sched.add(r)
    while len(sched.running) < 3:
        sched.step()
    sched.step()  # all three decoding (with overlap on: one step in flight)
    long = Req(req_id="long", prompt_ids=prompts(42, [300])[0], sampling=SamplingParams(max_tokens=4))
    sched.add(long)
    steps = 0
    while not long.output_ids:
        before = [len(r.output_ids) + sched.inflight(r) for r in running]
        sched.step()
        steps += 1
        check_invariants(sched)
        after = [len(r.output_ids) + sched.inflight(r) for r in running]
        assert [a - b for a, b in zip(after, before)] == [1, 1, 1], steps  # launched one token each, this step
    budget = MIN_PAGES * PAGE
    chunks = [e - s for rid, s, e in log.chunks if rid == "long"]
    assert chunks == [budget] * (300 // budget) + ([300 % budget] if 300 % budget else [])
    assert steps >= len(chunks)


def test_waiting_prompts_go_by_class_deadline_not_arrival(tiny_model: DecoderModel) -> None:
    """A batch prompt queued first and an interactive one queued after it: the interactive one is prefilled first
    (its TTFT deadline is earlier), the batch one right after, and both complete with every page back."""
    log = ChunkLog()
    sched = scheduler(tiny_model, TINY_TARGET_MS, overlap=False, connector=log)
    running = Req(req_id="d", prompt_ids=prompts(51, [9])[0], sampling=SamplingParams(max_tokens=60, ignore_eos=True))
    sched.add(running)
    while not sched.running:
        sched.step()
    batch_p, chat_p = prompts(52, [200, 200])
    batch = Req(req_id="batch", prompt_ids=batch_p, sampling=SamplingParams(max_tokens=2, slo_class="batch"))
    chat = Req(req_id="chat", prompt_ids=chat_p, sampling=SamplingParams(max_tokens=2, slo_class="interactive"))
    seen = len(log.chunks)
    sched.add(batch)
    sched.add(chat)
    assert [r.req_id for r in sched.waiting] == ["chat", "batch"]
    while not (batch.output_ids and chat.output_ids):
        sched.step()
        check_invariants(sched)
    order = [rid for rid, _, _ in log.chunks[seen:]]
    assert order.index("batch") > max(i for i, rid in enumerate(order) if rid == "chat")
    with pytest.raises(ValueError, match="unknown SLO class"):
        sched.add(Req(req_id="x", prompt_ids=[1, 2, 3], sampling=SamplingParams(slo_class="gold")))
    while sched.has_work():
        sched.step()
    assert_pool_clean_sched(sched)


def test_slo_target_is_the_tightest_class_being_decoded(tiny_model: DecoderModel) -> None:
    """The default target: the tightest ITL target among the classes of the requests decoding (every class's
    tightest while none decodes), each less its delivery allowance (tests/test_loop_lag.py), never below
    FLOOR_DECODE_STEPS measured decode steps."""
    sched = scheduler(tiny_model, ITL_TARGET_SLO, overlap=False)
    assert sched.pacing.itl_target_s() == 0.0  # no decode step measured yet
    relaxed = Req(
        req_id="b",
        prompt_ids=prompts(63, [12])[0],
        sampling=SamplingParams(max_tokens=40, slo_class="batch", ignore_eos=True),
    )
    sched.add(relaxed)
    while len(relaxed.output_ids) < 3:
        sched.step()
    step = sched.pacing.decode_step.seconds
    assert step > 0
    assert sched.pacing.itl_target_s() == pytest.approx(max(0.2, FLOOR_DECODE_STEPS * step))  # batch only: 200 ms
    chat = Req(req_id="c", prompt_ids=prompts(64, [12])[0], sampling=SamplingParams(max_tokens=40, ignore_eos=True))
    sched.add(chat)
    while not chat.output_ids:
        sched.step()
    assert sched.pacing.itl_target_s() == pytest.approx(
        max(0.05, FLOOR_DECODE_STEPS * sched.pacing.decode_step.seconds)
    )
    sched.abort("c")
    assert sched.pacing.itl_target_s() == pytest.approx(max(0.2, FLOOR_DECODE_STEPS * sched.pacing.decode_step.seconds))
    while sched.has_work():
        sched.step()


def test_short_prompts_beside_a_large_batch_share_one_step(tiny_model: DecoderModel) -> None:
    """Six requests decode; five 10-token prompts arrive together: one step prefills all five (their 50 tokens
    fit the budget) and decodes the six."""
    sched = scheduler(tiny_model, 1000.0, overlap=False, max_running=16)
    batch = [
        Req(req_id=f"d{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=40, ignore_eos=True))
        for i, p in enumerate(prompts(51, [20] * 6))
    ]
    for r in batch:
        sched.add(r)
    for _ in range(3):
        sched.step()
    assert len(sched.running) == 6
    short = [
        Req(req_id=f"s{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=5, ignore_eos=True))
        for i, p in enumerate(prompts(52, [10] * 5))
    ]
    for r in short:
        sched.add(r)
    events = sched.step()
    assert sched.processed_kind == "mixed"
    assert {e.req.req_id for e in events} == {r.req_id for r in batch + short}
    assert all(len(r.output_ids) == 1 for r in short)
    while sched.has_work():
        sched.step()
        check_invariants(sched)


def test_auto_target_follows_the_measured_decode_step(tiny_model: DecoderModel) -> None:
    """The `auto` target: no mixed step until a decode step has been measured, then the auto multiple (2) of
    it; the budget a worker publishes is the one its steps use."""
    sched = scheduler(tiny_model, ITL_TARGET_AUTO, overlap=False)
    assert sched.mixed_batching and sched.pacing.itl_target_s() == 0.0
    first = Req(req_id="a", prompt_ids=prompts(61, [20])[0], sampling=SamplingParams(max_tokens=30, ignore_eos=True))
    sched.add(first)
    sched.step()  # prefill alone: the whole budget, and a prefill speed
    assert sched.processed_kind == "prefill" and sched.pacing.prefill_speed.tokens_per_s > 0
    sched.add(Req(req_id="b", prompt_ids=prompts(62, [100])[0], sampling=SamplingParams(max_tokens=3)))
    sched.step()
    assert sched.processed_kind == "decode"  # the decode step that sets the target
    assert sched.pacing.itl_target_s() == pytest.approx(-ITL_TARGET_AUTO * sched.pacing.decode_step.seconds)
    sched.step()
    assert sched.processed_kind == "mixed"
    assert sched.prefill_token_budget(decoding=True) >= MIN_PAGES * PAGE
    while sched.has_work():
        sched.step()
        check_invariants(sched)


class Parking(KVConnector):
    """Holds every prompt prefilled for a peer; releases what the test puts in `done`."""

    transfers = True

    def __init__(self) -> None:
        self.parked: list[Req] = []
        self.done = FinishedTransfers()

    def prefill_done(self, req: Req) -> bool:
        self.parked.append(req)
        return True

    def finished(self) -> FinishedTransfers | None:
        done, self.done = self.done, FinishedTransfers()
        return done


def test_prefill_only_request_in_a_mixed_step_is_parked_and_decode_rows_are_not(tiny_model: DecoderModel) -> None:
    """A mixed worker prefills for a peer while it decodes: after its first token the peer's request is parked
    (its connector holds the pages) until its transfer is released, the decoding request keeps decoding."""
    parking = Parking()
    sched = scheduler(tiny_model, TINY_TARGET_MS, overlap=False, connector=parking)
    dec = Req(req_id="dec", prompt_ids=prompts(71, [9])[0], sampling=SamplingParams(max_tokens=50, ignore_eos=True))
    sched.add(dec)
    for _ in range(3):
        sched.step()
    peer = Req(
        req_id="peer", prompt_ids=prompts(72, [150])[0], sampling=SamplingParams(max_tokens=8), prefill_only=True
    )
    parked = parking.parked
    sched.add(peer)
    while not parked:
        sched.step()
        if not parked:  # a parked request keeps its row and pages outside the active set until released
            check_invariants(sched)
    assert parked == [peer] and len(peer.output_ids) == 1 and peer not in sched.running
    assert dec in sched.running and sched.processed_kind == "mixed"
    parking.done.released.append("peer")
    assert sched.settle_transfers() == []
    sched.abort("dec")
    sched.flush()
    assert_pool_clean_sched(sched)


def assert_pool_clean_sched(sched: Scheduler) -> None:
    cached = sched.cache.cached_pages if sched.cache is not None else 0
    assert sched.cache is None or sched.cache.protected_pages == 0
    assert sched.allocator.num_free + cached == sched.allocator.num_pages


def test_grammar_request_decodes_beside_chunks_with_the_same_tokens(smol_runner, smol_tokenizer) -> None:
    """A grammar-constrained request (host-side matcher) and a greedy one decode on the packaged model while a
    long prompt prefills in small chunks: the same tokens as prefill-first."""
    from common.offline import Engine
    from common.protocol import GrammarSpec

    chat = smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give a JSON object with a name and an age."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    schema = (
        '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]}'
    )
    long_prompt = smol_tokenizer("The history of the city " * 30)["input_ids"]
    outputs = {}
    for target in (0.0, TINY_TARGET_MS):
        engine = Engine(
            runner=smol_runner,
            sched_cfg=SchedulerConfig(max_prefill_tokens=512, itl_target_ms=target),
            load_tokenizer=False,
        )
        sched = engine.scheduler
        reqs = [
            Req(
                req_id="json",
                prompt_ids=list(chat),
                sampling=SamplingParams(max_tokens=40, grammar=GrammarSpec(kind="json_schema", value=schema)),
            ),
            Req(req_id="greedy", prompt_ids=list(chat), sampling=SamplingParams(max_tokens=12, ignore_eos=True)),
            Req(req_id="long", prompt_ids=list(long_prompt), sampling=SamplingParams(max_tokens=6, ignore_eos=True)),
        ]
        sched.add(reqs[0])
        sched.add(reqs[1])
        steps = 0
        while sched.has_work():
            if steps == 3:
                sched.add(reqs[2])
            sched.step()
            steps += 1
        outputs[target] = [(r.output_ids, r.finish_reason) for r in reqs]
        assert_pool_clean(engine)
    assert outputs[TINY_TARGET_MS] == outputs[0.0]
    assert outputs[0.0][0][1] == "stop"


def test_budget_comes_from_the_step_model_once_chunks_were_timed(tiny_model: DecoderModel) -> None:
    """Before any chunk was timed the budget is the prefill speed over the target less the decode step; once the
    step model has timed chunks, it is the model's largest chunk within the target (with the SLO's margin)."""
    sched = scheduler(tiny_model, 20.0, overlap=False, max_prefill_tokens=2048)
    # The whole target, whatever this loaded CPU's steps overrun (the trim has its own tests): chunks of one
    # size would leave the model nothing to fit a per-token cost from.
    sched.pacing.itl_trim.floor = 1.0
    sched.pacing.prefill_speed.observe(2048, 0.05)  # a large chunk: 40,960 tok/s
    assert not sched.pacing.step_model.ready
    assert sched.prefill_token_budget(decoding=True, context=StepContext()) == 816  # 20 ms of it, whole pages
    decoding = Req(
        req_id="d", prompt_ids=prompts(71, [12])[0], sampling=SamplingParams(max_tokens=200, ignore_eos=True)
    )
    sched.add(decoding)
    # Prompts of four sizes, each one chunk within the budget (the largest leaves the tiny model's 512-token context
    # room): the timed chunks differ in tokens, so a per-token cost stands out of a loaded CPU's noise; chunks all
    # of 150 tokens once left it at zero past 200 prompts, on an idle box.
    queued = iter(prompts(72, [32, 128, 256, 448] * 250))
    for i in range(2000):  # prompts arriving one after another beside the decoding request: mixed steps, timed
        if sched.pacing.step_model.ready:
            break
        if not sched.waiting and sched.chunked is None:
            sched.add(Req(req_id=f"p{i}", prompt_ids=next(queued), sampling=SamplingParams(max_tokens=2)))
        sched.step()
    assert sched.pacing.step_model.ready
    ctx = StepContext(3, 300, 0)
    want = sched.pacing.step_model.largest_chunk(0.02, 3, 300, 0, 2048, PAGE, sched.pacing.margin_z())
    # ... and never past the measured prefill speed over the target less the decode step (the fit's bound)
    speed, decode_s = sched.pacing.prefill_speed.peak_tokens_per_s, sched.pacing.decode_step.seconds
    want = min(want, int(speed * max(0.02 - decode_s, 0.0)) // PAGE * PAGE)
    assert sched.prefill_token_budget(decoding=True, context=ctx) == min(2048, max(MIN_PAGES * PAGE, want))
    assert sched.prefill_token_budget(decoding=False) == 2048
    while sched.has_work():
        sched.step()
