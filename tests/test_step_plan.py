"""The step plan as a function (common/sched/step_plan.py): what a step decodes and prefills, in what order,
under which budget and why, and whom it preempts; no model, no scheduler, nothing mutated."""

from __future__ import annotations

from dataclasses import replace

from common.protocol import GrammarSpec, SamplingParams
from common.sched.prefill_budget import BudgetReason, StepContext
from common.sched.request import Req, ReqState
from common.sched.step_plan import AdmitStop, PlanInputs, PrefixPeek, StepPlan, plan
from common.sched.waiting import WaitingQueue

PAGE = 16


def req(rid: str, prompt: int, max_tokens: int = 64, rank: int = 0, deadline: float = 0.0, **kw) -> Req:
    r = Req(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, **kw))
    r.slo_rank, r.deadline_s = rank, deadline
    return r


def running(rid: str, prompt: int, outputs: int, pages: int, reserve: int, **kw) -> Req:
    """A decoding request: its prompt and outputs computed but the last output, `pages` pages held."""
    r = req(rid, prompt, **kw)
    r.output_ids = [7] * outputs
    r.device_len = prompt + outputs
    r.cached_len = r.device_len - 1
    r.pages = list(range(pages))
    r.table_row, r.reserve_len, r.state = 0, reserve, ReqState.RUNNING
    return r


def inputs(**kw) -> PlanInputs:
    def budget(decoding: bool, ctx: StepContext) -> tuple[int, str]:
        return (64, BudgetReason.ITL_TARGET) if decoding else (256, BudgetReason.MAX_PREFILL_TOKENS)

    base = PlanInputs(
        running=[],
        chunked=None,
        waiting=[],
        inflight={},
        max_seq_len=4096,
        page_size=PAGE,
        mixed_batching=True,
        itl_target_s=0.05,
        budget=budget,
        spare_pages=1000,
        running_slots=16,
        reserve_len=lambda r: r.max_device_len,
        peek=lambda r: PrefixPeek(),
    )
    return replace(base, **kw)


def queued(*reqs: Req) -> WaitingQueue:
    q = WaitingQueue()
    for r in reqs:
        q.append(r)
    return q


def test_nothing_to_do_is_idle_and_decoding_alone_is_a_decode_step() -> None:
    assert plan(inputs()) == StepPlan("idle")
    a = running("a", 20, 3, 2, 84)
    p = plan(inputs(running=[a]))
    assert p.kind == "decode" and p.decode == (a,) and not p.chunks


def test_prompts_join_in_deadline_order_class_first_on_ties() -> None:
    """The queue's order is the plan's: earliest TTFT deadline, the higher class on a tie."""
    late = req("late", 32, deadline=5.0)
    early = req("early", 32, deadline=1.0)
    batch_tie = req("batch", 32, rank=1, deadline=1.0)
    p = plan(inputs(waiting=queued(late, batch_tie, early)))
    assert [c.req.req_id for c in p.chunks] == ["early", "batch", "late"]
    assert p.kind == "prefill" and p.token_budget == 256 and p.budget_reason == BudgetReason.MAX_PREFILL_TOKENS


def test_every_running_request_decodes_while_a_prompt_prefills_and_the_budget_says_why() -> None:
    a, b = running("a", 20, 3, 2, 84), running("b", 40, 9, 4, 104)
    long = req("long", 500)
    p = plan(inputs(running=[a, b], waiting=queued(long)))
    assert p.kind == "mixed" and p.decode == (a, b)
    assert [(c.req, c.tokens, c.admit) for c in p.chunks] == [(long, 64, True)]
    assert (p.token_budget, p.budget_reason, p.admit_stop) == (64, BudgetReason.ITL_TARGET, AdmitStop.QUEUE_EMPTY)
    # Prefill-first (no target: the budget is the cap): the prompt's step decodes nothing.
    cap = inputs(itl_target_s=0.0, mixed_batching=False, budget=lambda d, c: (256, BudgetReason.MAX_PREFILL_TOKENS))
    first = plan(replace(cap, running=[a, b], waiting=queued(long)))
    assert first.kind == "prefill" and first.decode == () and first.chunks[0].tokens == 256


def test_the_chunked_prompt_continues_first_and_a_batch_prompt_is_never_starved() -> None:
    """A prompt mid-prefill takes its next chunk before any admission; a batch-class prompt at the head of the
    queue (its patience ran out) is admitted like any other, beside the decode rows."""
    chunked = req("chunked", 300)
    chunked.cached_len, chunked.table_row, chunked.state = 128, 1, ReqState.PREFILLING
    batch = req("batch", 20, rank=1, deadline=0.0)
    chat = req("chat", 20, deadline=3.0)
    a = running("a", 20, 3, 2, 84)
    p = plan(inputs(running=[a], chunked=chunked, waiting=queued(chat, batch)))
    assert [(c.req.req_id, c.tokens, c.admit) for c in p.chunks] == [("chunked", 64, False)]
    assert p.admit_stop == AdmitStop.TOKENS and p.decode == (a,)
    p = plan(inputs(running=[a], waiting=queued(chat, batch)))
    assert [c.req.req_id for c in p.chunks] == ["batch", "chat"]


def test_admission_stops_at_pages_slots_and_a_token_in_flight() -> None:
    big, small = req("big", 32, max_tokens=1000), req("small", 32, max_tokens=16)
    p = plan(inputs(waiting=queued(big, small), spare_pages=40))  # big reserves 65 pages
    assert p.chunks == () and p.admit_stop == AdmitStop.PAGES and p.kind == "idle"
    p = plan(inputs(waiting=queued(small, big), running_slots=1))
    assert [c.req for c in p.chunks] == [small] and p.admit_stop == AdmitStop.MAX_RUNNING
    p = plan(inputs(waiting=queued(small), inflight={small: 1}))
    assert p.chunks == () and p.admit_stop == AdmitStop.IN_FLIGHT
    # A prefix hit: fewer tokens to compute, fewer pages to take, the pages it locks counted.
    hit = plan(inputs(waiting=queued(big), spare_pages=60, peek=lambda r: PrefixPeek(16, 1, 0)))
    assert hit.admit_stop == AdmitStop.PAGES
    hit = plan(inputs(waiting=queued(big), spare_pages=64, peek=lambda r: PrefixPeek(16, 1, 0)))
    assert [(c.req, c.tokens) for c in hit.chunks] == [(big, 16)]


def test_a_full_pool_preempts_the_lowest_class_latest_deadline_first_and_admits_nothing() -> None:
    """Optimistic reservation: decode rows that need a page beyond their reservation take it from the spare
    pages; when there are none, running requests are preempted: the lowest class first, then the latest
    deadline; a grammar request never. Nothing is admitted in a step that preempts."""
    grow = dict(outputs=13, pages=2, reserve=32)  # 33 tokens known, 32 on 2 pages: its next row needs a third
    chat_old = running("chat-old", 20, deadline=1.0, **grow)
    chat_new = running("chat-new", 20, deadline=2.0, **grow)
    batch = running("batch", 20, rank=1, deadline=0.5, **grow)
    schema = GrammarSpec(kind="json_schema", value="{}")
    structured = running("json", 20, rank=2, deadline=9.0, grammar=schema, **grow)
    waiting = queued(req("new", 16))
    view = inputs(
        running=[chat_old, chat_new, batch, structured],
        waiting=waiting,
        spare_pages=2,
        reserve_len=lambda r: r.reserve_len,
    )
    p = plan(view)
    # Four rows need a page each, two are spare: the batch request goes (2 pages back, 1 needed less), then the newer chat.
    assert p.preempt == (batch,)
    assert p.decode == (chat_old, chat_new, structured) and p.admit_stop == AdmitStop.PREEMPTING and not p.chunks
    p = plan(replace(view, spare_pages=0))
    assert p.preempt == (batch, chat_new) and p.decode == (chat_old, structured)
    # Within the reservation, nothing is preempted.
    assert plan(replace(view, spare_pages=4)).preempt == ()


def test_itl_trim_cuts_on_overruns_and_gives_back_after_calm_steps():
    from common.sched.itl_trim import ItlTrim

    trim = ItlTrim(calm_steps=10)
    for _ in range(3):
        trim.observe(0.055, 0.050)  # over the target: cut each time
    assert trim.overruns == 3 and abs(trim.factor - 0.95**3) < 1e-9
    for _ in range(200):
        trim.observe(0.055, 0.050)
    assert trim.factor == trim.floor  # never below the floor, however often it overruns
    before = trim.factor
    for _ in range(9):
        trim.observe(0.030, 0.050)
    assert trim.factor == before  # not yet a calm run
    trim.observe(0.030, 0.050)
    assert trim.factor > before
    for _ in range(100_000):
        trim.observe(0.030, 0.050)
    assert trim.factor == 1.0  # never above the whole target
    trim.observe(0.0, 0.050)
    trim.observe(0.060, 0.0)  # unmeasured periods and steps without a target change nothing
    assert trim.factor == 1.0 and trim.overruns == 203


def test_itl_trim_does_not_cut_for_a_host_stall_and_settles_at_the_rate_the_percentile_allows():
    """A gap past the target with the device busy for under half of it is a stall no chunk caused: counted, no cut.
    The calm run follows the allowed overrun rate: one cut is regrown after 1/rate chunk steps."""
    import math

    from common.sched.itl_trim import ItlTrim

    trim = ItlTrim()
    trim.observe(0.100, 0.050, device_s=0.015)  # 85 ms of host time: a stall
    assert (trim.stalls, trim.overruns, trim.factor) == (1, 0, 1.0)
    trim.observe(0.060, 0.050, device_s=0.045)  # the device ran past the target: the chunk's doing
    assert (trim.stalls, trim.overruns) == (1, 1) and trim.factor < 1.0
    for rate in (1 / 500, 1 / 5000):
        t = ItlTrim().allow_overruns(rate)
        steps_to_regrow_one_cut = t.calm_steps * math.log(1 / t.cut) / math.log(t.regrow)
        assert abs(steps_to_regrow_one_cut * rate - 1) < 0.05


def test_step_pacing_learns_a_stalled_gap_as_the_step_device_time_and_sets_the_trim_from_the_slo():
    """A back-to-back step whose gap was mostly host time teaches the step model its device time, so one stall
    neither pulls the fit nor widens the margin every later chunk keeps; the trim allows a fifth of the p99 tail."""
    from common.sched.itl_trim import OVERRUNS_PER_TAIL
    from common.sched.launched import Launched, StepTimer
    from common.sched.request_table import RequestTable
    from common.sched.step_model import StepShape
    from common.sched.step_pacing import StepPacing
    from common.settings import SchedulerConfig
    from common.slo import parse_slo_classes

    cfg = SchedulerConfig(itl_target_ms=50.0)
    pacing = StepPacing(cfg, PAGE, parse_slo_classes(cfg.slo_classes, cfg.slo_default_class), RequestTable())
    expected = _calm_steps_for(0.01 * OVERRUNS_PER_TAIL)
    assert pacing.itl_trim.calm_steps == expected

    def step(tokens: int, device_s: float, host_stall_s: float = 0.0) -> None:
        shape = StepShape(prefill_tokens=tokens, decode_rows=8, decode_context=4000)
        launched = Launched("mixed", [], timer=StepTimer(0.0, device_s), shape=shape)
        if pacing._processed_at is not None:  # launched before the last step was processed: back to back
            launched.launched_at = pacing._processed_at - 1.0
            pacing._processed_at -= device_s + host_stall_s  # the gap since then, as the streams saw it
        pacing.observe(launched)

    for i in range(64):
        step(256 * (1 + i % 4), 0.005 + 256 * (1 + i % 4) * 20e-6)
    spread = pacing.step_model.spread_s
    predicted = pacing.step_model.predict(StepShape(512, 8, 4000))
    step(512, 0.005 + 512 * 20e-6, host_stall_s=0.085)
    assert pacing.itl_trim.stalls == 1 and pacing.itl_trim.overruns == 0 and pacing.itl_trim.factor == 1.0
    for i in range(16):  # past a refit
        step(256 * (1 + i % 4), 0.005 + 256 * (1 + i % 4) * 20e-6)
    assert pacing.step_model.spread_s < spread + 0.001
    assert abs(pacing.step_model.predict(StepShape(512, 8, 4000)) - predicted) < 0.001


def _calm_steps_for(rate: float) -> int:
    from common.sched.itl_trim import ItlTrim

    return ItlTrim().allow_overruns(rate).calm_steps


def test_a_step_far_past_the_itl_target_is_logged_once_per_interval_with_its_shape(caplog) -> None:
    """One line says what the step computed, how long it took and what the model predicted; the next slow steps
    within the interval are counted into the following line, not logged each (quiet logs)."""
    import logging

    from common.sched.launched import Launched, StepTimer
    from common.sched.request_table import RequestTable
    from common.sched.step_model import StepShape
    from common.sched.step_pacing import SLOW_STEP_LOG_S, StepPacing
    from common.settings import SchedulerConfig
    from common.slo import parse_slo_classes

    cfg = SchedulerConfig(itl_target_ms=50.0)
    pacing = StepPacing(cfg, PAGE, parse_slo_classes(cfg.slo_classes, cfg.slo_default_class), RequestTable())
    shape = StepShape(prefill_tokens=512, decode_rows=8, decode_context=4000)

    def step(seconds: float) -> None:
        pacing.observe(Launched("mixed", [], timer=StepTimer(0.0, seconds), shape=shape))

    with caplog.at_level(logging.WARNING, logger="kvferry.sched"):
        step(0.060)  # within 1.25 x 50 ms: not a slow step
        step(0.080)
        step(0.090)  # slow, but within the interval: counted
        pacing._slow_logged_at -= SLOW_STEP_LOG_S
        step(0.100)
        # A quick step after the host held the streams for 120 ms since the last decoding step: a gap they saw.
        pacing._slow_logged_at -= SLOW_STEP_LOG_S
        assert pacing._processed_at is not None
        pacing._processed_at -= 0.120
        step(0.010)
    lines = [r for r in caplog.records if r.getMessage() == "slow step"]
    assert [(r.ms, r.target_ms, r.slow_steps) for r in lines[:2]] == [(80.0, 50.0, 1), (100.0, 50.0, 2)]
    assert len(lines) == 3 and 120.0 <= lines[2].ms < 150.0 and lines[2].device_ms == 10.0
    assert (lines[0].kind, lines[0].decode_rows, lines[0].prefill_tokens, lines[0].decode_context) == (
        "mixed",
        8,
        512,
        4000,
    )


def test_a_step_after_every_stream_ended_is_not_read_as_a_token_gap(tmp_path, caplog) -> None:
    """A decode worker whose last request finished waits for the next one (its KV from a peer): that wait is no
    stream's gap, so the next step is neither a slow step nor a long gap in the trace."""
    import json
    import time

    from common.sched.launched import Launched, StepTimer
    from common.sched.request_table import RequestTable
    from common.sched.step_model import StepShape
    from common.sched.step_pacing import StepPacing
    from common.settings import SchedulerConfig
    from common.slo import parse_slo_classes

    path = tmp_path / "steps.jsonl"
    cfg = SchedulerConfig(itl_target_ms=50.0, step_trace=str(path))
    pacing = StepPacing(cfg, PAGE, parse_slo_classes(cfg.slo_classes, cfg.slo_default_class), RequestTable())
    one_row = StepShape(decode_rows=1, decode_context=100)
    caplog.set_level("WARNING", logger="kvferry.sched")
    pacing.observe(Launched("decode", [], timer=StepTimer(0.0, 0.005), shape=one_row))
    pacing.streams_ended()
    time.sleep(0.08)  # over the 50 ms target: read as a gap, it would be a slow step
    pacing.observe(Launched("decode", [], timer=StepTimer(0.0, 0.005), shape=one_row))
    time.sleep(0.08)  # a stream running: this one is a gap
    pacing.observe(Launched("decode", [], timer=StepTimer(0.0, 0.005), shape=one_row))
    assert pacing.trace is not None
    pacing.trace.close()
    gaps = [json.loads(line)["gap_s"] for line in path.read_text().splitlines()]
    assert gaps[1] == 0.0 and gaps[2] >= 0.08
    slow = [r for r in caplog.records if r.getMessage() == "slow step"]
    assert len(slow) == 1 and slow[0].ms >= 80  # the second wait only
    assert slow[0].next_launch_host_ms == 0.0  # what launching the step after it took (set by the scheduler)


def test_step_trace_writes_one_json_line_per_timed_step(tmp_path) -> None:
    """KVFERRY_STEP_TRACE: each timed step as the model saw it (shape, device time, gap, prediction, target, the
    host's share)."""
    import json

    from common.sched.launched import Launched, StepTimer
    from common.sched.request_table import RequestTable
    from common.sched.step_model import StepShape
    from common.sched.step_pacing import StepPacing
    from common.settings import SchedulerConfig
    from common.slo import parse_slo_classes

    path = tmp_path / "steps.jsonl"
    cfg = SchedulerConfig(itl_target_ms=50.0, step_trace=str(path))
    pacing = StepPacing(cfg, PAGE, parse_slo_classes(cfg.slo_classes, cfg.slo_default_class), RequestTable())
    shape = StepShape(prefill_tokens=512, decode_rows=8, decode_context=4000)
    pacing.observe(Launched("mixed", [], timer=StepTimer(0.0, 0.020), shape=shape, launch_host_s=0.003))
    pacing.observe(
        Launched("decode", [], timer=StepTimer(0.0, 0.005), shape=StepShape(decode_rows=8), process_host_s=0.002)
    )
    pacing.observe(Launched("mixed", [], shape=shape))  # not timed: not written
    assert pacing.trace is not None
    pacing.trace.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["prefill_tokens"], r["decode_rows"], r["device_s"]) for r in rows] == [
        ("mixed", 512, 8, 0.02),
        ("decode", 0, 8, 0.005),
    ]
    assert rows[0]["target_s"] == 0.05 and rows[1]["gap_s"] > 0
    # the host's share, and a wall clock to line the steps up with a client's token gaps
    assert [(r["launch_host_s"], r["process_host_s"]) for r in rows] == [(0.003, 0.0), (0.0, 0.002)]
    assert 0 < rows[1]["t"] - rows[0]["t"] < 60


def test_a_chunk_beside_decode_rows_is_held_to_what_the_step_graphs_leave() -> None:
    """On a GPU a prefill or mixed step of up to `graphed_tokens` tokens (prompt tokens and decode rows) replays
    piecewise graphs; one token more launches eagerly, 40 ms of host time for an FP8 8B step, and the decode step
    in flight before it waits. So beside decode rows the chunk takes at most what the rows leave of the graphs,
    in whole pages, unless the rows take more than half of them; alone, or with no graphs (the CPU), it is
    unchanged."""
    from common.sched.prefill_budget import within_graphs
    from common.sched.request_table import RequestTable
    from common.sched.step_pacing import StepPacing
    from common.settings import SchedulerConfig
    from common.slo import parse_slo_classes

    assert within_graphs(2048, BudgetReason.MAX_PREFILL_TOKENS, 145, 2048, 16) == (1888, BudgetReason.GRAPHS)
    assert within_graphs(2048, BudgetReason.MAX_PREFILL_TOKENS, 145, 2560, 16) == (2048, "max_prefill_tokens")
    assert within_graphs(1024, BudgetReason.ITL_TARGET, 145, 2048, 16) == (1024, "itl_target")  # fits already
    assert within_graphs(2048, BudgetReason.ITL_TARGET, 1100, 2048, 16) == (2048, "itl_target")  # rows: most of it
    assert within_graphs(2048, BudgetReason.ITL_TARGET, 145, 0, 16) == (2048, "itl_target")  # no graphs

    def pacing(itl_target_ms: float) -> StepPacing:
        cfg = SchedulerConfig(max_prefill_tokens=4096, itl_target_ms=itl_target_ms)
        p = StepPacing(cfg, 16, parse_slo_classes(cfg.slo_classes, cfg.slo_default_class), RequestTable())
        p.graphed_tokens = 2560
        return p

    beside = StepContext(decode_rows=200, decode_context=200 * 1500)
    assert pacing(50.0).budget(True, beside) == (2352, BudgetReason.GRAPHS)  # unmeasured: the cap, held
    assert pacing(50.0).budget(False, StepContext())[0] == 4096  # nothing decodes: no stream waits on the launch
    assert pacing(0.0).budget(True, beside)[0] == 4096  # prefill-first: its prompt steps carry no decode rows


def test_the_cpu_runner_graphs_no_steps(smol_runner) -> None:
    assert smol_runner.graphed_step_tokens == 0
