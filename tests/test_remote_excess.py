"""A remote prefill's cost beyond its prediction (router/decision/remote_excess.py): the tracker's medians, floor,
cap and warm-up; then the router's own dispatcher under adaptive placement, where a peer predicted a little faster
than the decode pod wins until served requests show the remote path's first tokens coming later than predicted by
more than local ones, and the decode pod wins from then on. Fixed placement learns nothing."""

from __future__ import annotations

import time
from unittest import mock

import pytest

from common.slo import parse_slo_classes
from router.decision.cost_model import SloTargets
from router.decision.dispatch import Dispatcher, PromptPlan
from router.decision.load import parse_load
from router.decision.policy import PolicyConfig, RoutingPolicy
from router.decision.pool import WorkerPool
from router.decision.remote_excess import MAX_EXCESS_S, MIN_SAMPLES, WINDOW, RemoteExcess
from router.metrics import RouterMetrics
from router.settings import RouterOptions
from router.timeline import RequestLog

SLO = parse_slo_classes("interactive:ttft=1s,itl=50ms,p=99")
INTERACTIVE = SLO.get("interactive")
PROMPT = 2000


def _fill(e: RemoteExcess, remote: bool, excess_s: float, n: int = MIN_SAMPLES) -> None:
    for _ in range(n):
        e.observe(remote, 0.2 + excess_s, 0.2)


def test_the_excess_is_the_remote_median_over_the_local_one_once_both_are_seen() -> None:
    e = RemoteExcess()
    _fill(e, True, 0.12)
    _fill(e, False, 0.02, MIN_SAMPLES - 1)
    assert e.excess_s == 0.0  # one path short of its samples: the predictions stand
    _fill(e, False, 0.02, 1)
    assert e.excess_s == pytest.approx(0.10)  # what both paths share (0.02) cancels
    for _ in range(3):  # a few stalls move a median little
        e.observe(True, 2.0, 0.2)
    assert e.excess_s == pytest.approx(0.10)
    _fill(e, True, 0.05, WINDOW)  # the window keeps the recent placements only
    assert e.excess_s == pytest.approx(0.03)


def test_a_faster_remote_path_adds_nothing_and_a_broken_one_is_capped() -> None:
    e = RemoteExcess()
    _fill(e, False, 0.08)
    _fill(e, True, 0.02)
    assert e.excess_s == 0.0
    _fill(e, True, 5.0, WINDOW)
    assert e.excess_s == MAX_EXCESS_S


def _report(pool: WorkerPool, url: str, role: str, queued_tokens: int) -> None:
    """10 ms a step plus 10 us a prompt token, 1,000-token chunks (a 20 ms gap, within the 50 ms ITL target), a
    40-row batch decoding, `queued_tokens` ahead."""
    snap = {
        "role": role,
        "pod": url.removeprefix("http://"),
        "ready": True,
        "free_pages": 10_000,
        "total_pages": 10_000,
        "running_requests": 40,
        "decode_rows": 40,
        "step_coefficients": {"base_s": 0.01, "per_prefill_token_s": 1e-5},
        "step_chunk_tokens": 1000,
        "queued_prefill_tokens": queued_tokens,
        "queued_ahead_tokens": {"interactive": queued_tokens},
    }
    # asked "later" than every placement so far: the snapshot counts them, none is added as unseen
    pool.report_load(pool.workers[url], parse_load(snap), time.monotonic() + 60)


def _dispatcher(placement: str) -> Dispatcher:
    pool = WorkerPool(client=None)  # type: ignore[arg-type]
    pool.set_targets("decode", ["http://d0"])
    pool.set_targets("prefill", ["http://p0"])
    cfg = PolicyConfig(placement=placement, transfer_tokens_per_s=1e6, targets=SloTargets(1.0, 0.05))
    return Dispatcher(
        pool,
        RoutingPolicy(cfg),
        locator=None,  # type: ignore[arg-type]
        client=None,  # type: ignore[arg-type]
        opts=RouterOptions(),
        slo=SLO,
    )


def _route(d: Dispatcher, log: RequestLog, peer_queue: int, late_s: float | None = None) -> tuple[str | None, float]:
    """One request placed with 1,000 tokens queued on the decode pod and `peer_queue` on the peer (fresh loads each
    time); served `late_s` after its prediction where given. Its prefill pod (None: local) and prediction."""
    _report(d.pool, "http://d0", "decode", 1000)
    _report(d.pool, "http://p0", "prefill", peer_queue)
    plan = PromptPlan(list(range(PROMPT)), [], {}, 16, log.begin(False, None, "/v1/completions"), slo_class=INTERACTIVE)
    decision = d.route(plan, 16, set(), set())
    record = plan.record
    assert record is not None and record.predicted_ttft_s is not None
    if late_s is not None:
        now = time.monotonic()
        record.started = now - (record.predicted_ttft_s + late_s)
        with mock.patch("time.monotonic", return_value=now):
            record.first_token([])
    return decision.prefill, record.predicted_ttft_s


def test_adaptive_placement_prices_the_remote_paths_measured_excess() -> None:
    d, log = _dispatcher("adaptive"), RequestLog(RouterMetrics())
    # local: 3 steps x 10 ms + 3,000 tokens x 10 us = 60 ms; the peer with 500 queued: 55 ms + 2 ms of bytes
    prefill, predicted = _route(d, log, 500)
    assert prefill == "http://p0" and predicted == pytest.approx(0.057)
    for _ in range(MIN_SAMPLES):  # the peer's first tokens come 30 ms past their predictions ...
        assert _route(d, log, 500, late_s=0.03)[0] == "http://p0"
    for _ in range(MIN_SAMPLES):  # ... the decode pod's 20 ms (the peer is busier meanwhile)
        assert _route(d, log, 3000, late_s=0.02)[0] is None
    assert d.remote_excess.excess_s == pytest.approx(0.01)
    prefill, predicted = _route(d, log, 500)
    assert prefill is None and predicted == pytest.approx(0.06)  # 57 + 10 ms loses to 60 now
    prefill, predicted = _route(d, log, 0)  # an idle peer still wins, priced with the excess
    assert prefill == "http://p0" and predicted == pytest.approx(0.042 + 0.01)
    # served as late as the raw prediction said before: the excess it was priced with does not count twice
    for _ in range(WINDOW):
        _route(d, log, 0, late_s=0.03 - 0.01)
    assert d.remote_excess.excess_s == pytest.approx(0.01)


def test_fixed_placement_learns_no_excess() -> None:
    d, log = _dispatcher("fixed"), RequestLog(RouterMetrics())
    for _ in range(MIN_SAMPLES):
        _route(d, log, 800, late_s=0.12)
    assert d.remote_excess.excess_s == 0.0


def test_a_path_sample_takes_off_the_excess_its_prediction_was_made_with() -> None:
    d, log = _dispatcher("adaptive"), RequestLog(RouterMetrics())
    for _ in range(MIN_SAMPLES):
        _route(d, log, 500, late_s=0.03)
        _route(d, log, 3000, late_s=0.02)
    assert d.remote_excess.excess_s == pytest.approx(0.01)
    _report(d.pool, "http://d0", "decode", 1000)
    _report(d.pool, "http://p0", "prefill", 0)
    plan = PromptPlan(list(range(PROMPT)), [], {}, 16, log.begin(False, None, "/v1/completions"), slo_class=INTERACTIVE)
    d.check_ttft(plan, INTERACTIVE)  # admission predicts with the excess of now (10 ms) ...
    _fill(d.remote_excess, True, 0.05, WINDOW)  # ... other requests' first tokens move it before this one is placed
    assert d.remote_excess.excess_s > 0.01
    decision = d.route(plan, 16, set(), set())  # the placement reads admission's prediction again
    record = plan.record
    assert decision.prefill == "http://p0" and record is not None
    assert record.predicted_ttft_s == pytest.approx(0.042 + 0.01)
    with mock.patch.object(RemoteExcess, "observe", autospec=True) as observe:
        record.first_token([])
    _, remote, _, raw = observe.call_args.args
    assert remote is True and raw == pytest.approx(0.042)  # the 10 ms it included, not today's excess
