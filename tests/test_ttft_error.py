"""TTFT admission corrected by its own error (router/decision/ttft_error.py): served requests' measured over
predicted TTFT scale the predictions admission compares with a class's target. The quantile, the relevance
filter, the bounds, the two periods an error must show in and the lapse on the pure tracker; then the router's own
dispatcher: a request admitted on its prediction is refused once served requests have come back later than
predicted, through the same path a served request takes (placement, then its first token), and admitted again
once those samples are old."""

from __future__ import annotations

import time
from unittest import mock

import pytest

from common.slo import parse_slo_classes
from router.decision.dispatch import Dispatcher, PromptPlan
from router.decision.load import parse_load
from router.decision.policy import RoutingPolicy
from router.decision.pool import WorkerPool
from router.decision.ttft_error import GAP_S, MAX_FACTOR, MIN_SAMPLES, PERIOD_S, RELEVANT_SHARE, PredictionError
from router.errors import OpenAIError
from router.metrics import RouterMetrics
from router.settings import RouterOptions
from router.timeline import RequestLog

SLO = parse_slo_classes("interactive:ttft=1s,itl=50ms,p=99;batch:ttft=none,itl=200ms,p=99")
INTERACTIVE = SLO.get("interactive")


def _steady(e: PredictionError, start: float, seconds: float, ratio: float | None = None, per_s: float = 10.0) -> float:
    """Relevant requests served every 1 / `per_s` s for `seconds` from `start`, each `ratio` late (None: ratios
    1.00 .. 1.99 in turn); returns the time after the last."""
    n = int(seconds * per_s)
    for i in range(n):
        r = ratio if ratio is not None else 1.0 + (i % 100) / 100
        e.observe(start + i / per_s, r, 1.0, 1.0)
    return start + n / per_s


def test_the_factor_is_the_quantile_of_relevant_ratios_shown_in_two_periods_within_bounds() -> None:
    e = PredictionError(0.9)
    t = _steady(e, 0.0, PERIOD_S, 1.5)
    assert e.factor(t) == 1.0  # one period alone sets nothing
    t = _steady(e, t, PERIOD_S + GAP_S, 1.5)
    assert e.factor(t) == pytest.approx(1.5)  # recurring: shown in both
    t = _steady(e, t, 2 * PERIOD_S + GAP_S, 0.5)
    assert e.factor(t) == 1.0  # early predictions do not loosen admission below 1
    t = _steady(e, t, 2 * PERIOD_S + GAP_S, 5.0)
    assert e.factor(t) == MAX_FACTOR  # at most shedding twice as early
    assert e.factor(t + PERIOD_S + 1) == 1.0  # nothing fresh: the predictions stand


def test_a_stall_confined_to_a_few_seconds_does_not_set_the_factor_a_recurring_error_does() -> None:
    """One stall of a second (every request then 4x late) between steady, well-predicted load leaves the factor at 1
    in every period it could sit in; the same lateness every few seconds sets it."""
    e = PredictionError()
    t = _steady(e, 0.0, 2 * PERIOD_S + GAP_S, 0.8)
    t = _steady(e, t, 1.0, 4.0)  # the stall
    end = t + 3 * PERIOD_S
    while t < end:
        t = _steady(e, t, 0.5, 0.8)
        assert e.factor(t) == 1.0, t
    recurring = PredictionError()
    t = 0.0
    for _ in range(int(3 * PERIOD_S / 2)):
        t = _steady(recurring, t, 1.9, 0.8)
        t = _steady(recurring, t, 0.1, 1.6)  # one in twenty, every two seconds
    assert recurring.factor(t) == pytest.approx(1.6)


def test_at_a_few_relevant_requests_a_second_the_periods_stretch_to_hold_enough() -> None:
    """One relevant request every 2 s (a large model's deployment near saturation): a recurring error still sets
    the factor once two periods hold `MIN_SAMPLES` each, and three requests late together still set nothing."""
    slow = PredictionError()
    t = _steady(slow, 0.0, 4 * MIN_SAMPLES + GAP_S + 2, 1.5, per_s=0.5)
    assert slow.factor(t) == pytest.approx(1.5)
    stalled = PredictionError()
    t = _steady(stalled, 0.0, 4 * MIN_SAMPLES, 0.8, per_s=0.5)
    t = _steady(stalled, t, 0.3, 4.0)  # the stall: three first tokens late together
    for _ in range(2 * MIN_SAMPLES):
        t = _steady(stalled, t, 2.0, 0.8, per_s=0.5)
        assert stalled.factor(t) == 1.0, t


def test_a_busy_router_process_keeps_both_periods() -> None:
    """300 relevant requests a second through one process: both periods and the gap between them stay in what the
    tracker keeps, so a recurring error sets the factor there too."""
    busy = PredictionError()
    t = _steady(busy, 0.0, 2 * PERIOD_S + GAP_S + 1, 1.5, per_s=300)
    assert busy.factor(t) == pytest.approx(1.5)


def test_quick_requests_and_classes_without_a_target_do_not_count_late_ones_do() -> None:
    e = PredictionError(0.9)
    short = 0.9 * RELEVANT_SHARE
    for i in range(300):
        e.observe(float(i) * 0.1, short, short / 4, 1.0)  # predicted and served quickly: fixed costs
        e.observe(float(i) * 0.1, 3.0, 0.8, None)  # no TTFT target
    assert e.factor(30.0) == 1.0
    for i in range(int((2 * PERIOD_S + GAP_S) * 10)):
        e.observe(31.0 + i * 0.1, 0.9, 0.3, 1.0)  # predicted quickly, served late: the error that matters
    assert e.factor(31.0 + 2 * PERIOD_S + GAP_S) == pytest.approx(3.0 if 3.0 <= MAX_FACTOR else MAX_FACTOR)
    off = PredictionError(0.0)
    for i in range(300):
        off.observe(float(i) * 0.1, 3.0, 0.8, 1.0)
    assert off.factor(30.0) == 1.0


def test_quantile_reads_the_upper_tail() -> None:
    e = PredictionError(0.9)
    t = _steady(e, 0.0, 2 * PERIOD_S + GAP_S, per_s=100 / PERIOD_S)  # ratios 1.00 .. 1.99 in every period
    assert e.factor(t) == pytest.approx(1.9, abs=0.011)


def _report(pool: WorkerPool, queued_tokens: int) -> None:
    """decode0's load: 10 ms a step plus 0.1 ms a prompt token, 1,000-token chunks, `queued_tokens` ahead."""
    snap = {
        "role": "decode",
        "pod": "decode0",
        "ready": True,
        "free_pages": 10_000,
        "total_pages": 10_000,
        "step_coefficients": {"base_s": 0.01, "per_prefill_token_s": 1e-4},
        "step_chunk_tokens": 1000,
        "queued_prefill_tokens": queued_tokens,
        "queued_ahead_tokens": {"interactive": queued_tokens},
    }
    pool.report_load(pool.workers["http://decode0"], parse_load(snap))


def _dispatcher(queued_tokens: int, quantile: float = 0.9) -> Dispatcher:
    pool = WorkerPool(client=None)  # type: ignore[arg-type]
    pool.set_targets("decode", ["http://decode0"])
    _report(pool, queued_tokens)
    return Dispatcher(
        pool,
        RoutingPolicy(),
        locator=None,  # type: ignore[arg-type]
        client=None,  # type: ignore[arg-type]
        opts=RouterOptions(ttft_error_quantile=quantile),
        slo=SLO,
    )


def _plan(log: RequestLog | None = None) -> PromptPlan:
    record = log.begin(False, None, "/v1/completions") if log is not None else None
    return PromptPlan(list(range(3000)), [], {}, 16, record, slo_class=INTERACTIVE)


def _served(d: Dispatcher, log: RequestLog, ttft_s: float, ago_s: float = 0.0) -> float:
    """One request through admission and placement, its first token `ttft_s` after it arrived and `ago_s` before
    now; its prediction."""
    plan = _plan(log)
    d.check_ttft(plan, INTERACTIVE)
    d.route(plan, 16, set(), set())
    assert plan.record is not None and plan.record.predicted_ttft_s is not None
    now = time.monotonic() - ago_s
    plan.record.started = now - ttft_s
    with mock.patch("time.monotonic", return_value=now):  # the first token exactly `ttft_s` after arrival
        plan.record.first_token([])
    return plan.record.predicted_ttft_s


@pytest.mark.parametrize("quantile", [0.9, 0.0])
def test_admission_sheds_earlier_once_served_requests_came_back_later_than_predicted(quantile: float) -> None:
    # 4,000 tokens queued ahead + 3,000 of its own in 1,000-token steps: 7 x 10 ms + 7,000 x 0.1 ms = 0.77 s
    d, log = _dispatcher(4000, quantile), RequestLog(RouterMetrics())
    assert d.check_ttft(_plan(), INTERACTIVE) == pytest.approx(0.77)
    for ago in (PERIOD_S + GAP_S + 1, 0.0):  # in two periods: an error that recurs
        for _ in range(MIN_SAMPLES):
            assert _served(d, log, 1.2, ago) == pytest.approx(0.77)  # each came back 1.56x later than predicted
    if quantile == 0:
        assert d.check_ttft(_plan(), INTERACTIVE) == pytest.approx(0.77)  # off: the prediction stands
        return
    with pytest.raises(OpenAIError) as refused:
        d.check_ttft(_plan(), INTERACTIVE)  # 0.77 x 1.56 = 1.2 s: past the 1 s target
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
    # a lighter queue stays admitted under the same correction: 2,000 ahead -> 0.55 s x 1.56 = 0.86 s
    _report(d.pool, 2000)
    assert d.check_ttft(_plan(), INTERACTIVE) == pytest.approx(0.55 * 1.2 / 0.77)
    d.ttft_error._last_at -= PERIOD_S + 1  # the samples age out: the prediction stands again
    assert d.check_ttft(_plan(), INTERACTIVE) == pytest.approx(0.55)


def test_by_default_a_tail_of_late_requests_a_few_percent_wide_sets_the_factor() -> None:
    """Deep in overload every admitted request sits at the edge, where the quantile is the share that meets the
    target: the default holds 99% of them, so 3% coming back 1.5x late is enough to shed that much earlier."""
    e = PredictionError()
    for i in range(200):
        e.observe(float(i) * 0.1, 1.5 if i % 33 == 0 else 1.0, 1.0, 1.0)  # 7 of 200 late
    assert e.factor(20.0) == pytest.approx(1.5)
    assert e.quantile == 0.99
