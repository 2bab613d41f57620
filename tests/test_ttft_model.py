"""The router's TTFT predictor (router/decision/ttft_model.py) and admission by predicted TTFT (router/decision/admission.py
`ttft_verdict`): pure functions over plain figures."""

from __future__ import annotations

import math

import pytest

from common.slo import parse_slo_classes
from router.decision.admission import LOWER_CLASS_HEADROOM, QUEUE_ALLOWANCE, ttft_verdict
from router.decision.load import parse_load
from router.decision.ttft_model import StepCost, WorkerFigures, predict_ttft_s, prefill_rate

# 1 ms a prompt token, 10 ms a step, 1 ms a decode row, nothing per context token or attention pair.
COST = StepCost(base_s=0.010, per_prefill_token_s=0.001, per_decode_row_s=0.001)


def figures(**kw: object) -> WorkerFigures:
    base: dict[str, object] = {"chunk_tokens": 256, "cost": COST}
    base.update(kw)
    return WorkerFigures(**base)  # type: ignore[arg-type]


def test_idle_worker_predicts_its_own_prompt() -> None:
    # 512 tokens in two 256-token steps: 2 x 10 ms + 512 x 1 ms.
    assert predict_ttft_s(figures(), "interactive", 512) == pytest.approx(0.020 + 0.512)


def test_queued_tokens_ahead_of_the_class_wait_first() -> None:
    w = figures(ahead_tokens={"interactive": 256, "batch": 2048}, queued_tokens=2048)
    inter = predict_ttft_s(w, "interactive", 256)
    batch = predict_ttft_s(w, "batch", 256)
    assert inter == pytest.approx(2 * 0.010 + 512 * 0.001)
    assert batch == pytest.approx(9 * 0.010 + 2304 * 0.001)
    # A class the worker did not report waits behind everything queued.
    assert predict_ttft_s(w, "other", 256) == pytest.approx(batch)


def test_unseen_placements_queue_ahead() -> None:
    seen = predict_ttft_s(figures(), "interactive", 256)
    unseen = predict_ttft_s(figures(unseen_tokens=512), "interactive", 256)
    assert seen is not None and unseen is not None
    assert unseen - seen == pytest.approx(2 * 0.010 + 512 * 0.001)


def test_decode_batch_slows_every_step() -> None:
    alone = predict_ttft_s(figures(), "interactive", 1024)
    beside = predict_ttft_s(figures(decode_rows=20, chunk_tokens=128), "interactive", 1024)
    assert alone is not None and beside is not None
    # 8 steps of 10 + 20 ms instead of 4 of 10 ms.
    assert beside - alone == pytest.approx(8 * 0.030 - 4 * 0.010)
    assert prefill_rate(figures(decode_rows=20, chunk_tokens=128)) == pytest.approx(128 / (0.030 + 0.128))


def test_attention_pairs_of_the_own_prompt() -> None:
    cost = StepCost(base_s=0.0, per_prefill_token_s=0.001, per_attention_pair_s=1e-6)
    t = predict_ttft_s(WorkerFigures(chunk_tokens=512, cost=cost), "interactive", 1000)
    assert t == pytest.approx(1.0 + 1e-6 * 1000 * 1000 / 2)


def test_disaggregated_transfer_adds() -> None:
    t = predict_ttft_s(figures(), "interactive", 256, transfer_s=0.25)
    assert t == pytest.approx(0.010 + 0.256 + 0.25)


def test_fallback_to_measured_rate_and_none_without_it() -> None:
    w = WorkerFigures(queued_tokens=1000, rate_tokens_per_s=500.0)
    assert predict_ttft_s(w, "interactive", 500) == pytest.approx(3.0)
    assert predict_ttft_s(WorkerFigures(queued_tokens=1000), "interactive", 500) is None


def test_figures_from_load() -> None:
    load = parse_load(
        {
            "role": "decode",
            "pod": "d0",
            "queued_prefill_tokens": 900,
            "step_coefficients": {"base_s": 0.01, "per_prefill_token_s": 0.001, "junk": "x"},
            "step_chunk_tokens": 256,
            "decode_rows": 3,
            "decode_context": 999,
            "queued_ahead_tokens": {"interactive": 100, "batch": 900},
        }
    )
    w = WorkerFigures.from_load(load, unseen_tokens=7)
    assert w.cost == StepCost(base_s=0.01, per_prefill_token_s=0.001)
    assert (w.chunk_tokens, w.decode_rows, w.decode_context) == (256, 3, 999)
    assert w.ahead("interactive") == 107 and w.ahead("batch") == 907 and w.ahead("x") == 907


# ---- admission ---------------------------------------------------------------------------------------------
SLO = parse_slo_classes("gold:ttft=1s,itl=50ms;silver:ttft=4s,itl=100ms;batch:ttft=none,itl=200ms")


def test_shed_only_past_the_target_with_retry_after_from_the_excess() -> None:
    gold = SLO.get("gold")
    assert not ttft_verdict(SLO, gold, lambda k: 1.0).shed  # exactly at the target: served
    v = ttft_verdict(SLO, gold, lambda k: 3.2)
    assert v.shed and v.limiting_class == "gold"
    assert v.excess_s == pytest.approx(2.2) and v.retry_after_s == 3  # ceil(2.2)
    assert ttft_verdict(SLO, gold, lambda k: 1.01).retry_after_s == 1  # at least 1 s


@pytest.mark.parametrize("wait", [0.5, 2.0, 7.3, 30.0])
def test_retry_after_follows_the_predicted_wait(wait: float) -> None:
    # Silver predicted `wait` past its 4 s target, gold well within its own: the excess is silver's.
    v = ttft_verdict(SLO, SLO.get("silver"), lambda k: 4.0 + wait if k.name == "silver" else 0.1)
    assert v.shed and v.limiting_class == "silver"
    assert v.retry_after_s == max(1, math.ceil(wait))
    # Gold past its headroom by more: that excess decides.
    v = ttft_verdict(SLO, SLO.get("silver"), lambda k: 4.0 + wait if k.name == "silver" else 1.0 + wait)
    assert v.retry_after_s == math.ceil(1.0 + wait - LOWER_CLASS_HEADROOM * 1.0)


def test_nothing_predicted_is_never_shed() -> None:
    assert not ttft_verdict(SLO, SLO.get("gold"), lambda k: None).shed


def test_batch_is_never_shed_for_ttft() -> None:
    assert not ttft_verdict(SLO, SLO.get("batch"), lambda k: 1e6).shed


def test_lower_classes_shed_first() -> None:
    # A queue where gold is predicted at 0.9 s: gold (target 1 s) is served; silver is refused though its own
    # prediction (3 s) meets its 4 s target, because gold is past LOWER_CLASS_HEADROOM of its target.
    preds = {"gold": 0.9, "silver": 3.0, "batch": 60.0}
    assert not ttft_verdict(SLO, SLO.get("gold"), lambda k: preds[k.name]).shed
    v = ttft_verdict(SLO, SLO.get("silver"), lambda k: preds[k.name])
    assert v.shed and v.limiting_class == "gold" and v.retry_after_s == 1
    assert not ttft_verdict(SLO, SLO.get("batch"), lambda k: preds[k.name]).shed
    # Lighter load: everyone within reach is served.
    light = {"gold": 0.5, "silver": 2.0, "batch": 9.0}
    assert not any(ttft_verdict(SLO, c, lambda k: light[k.name]).shed for c in SLO.classes)


@pytest.mark.parametrize("load", [0.1 * i for i in range(1, 60)])
def test_a_higher_class_is_never_shed_while_a_lower_one_is_served(load: float) -> None:
    # Predictions grow with the load, later-deadline classes waiting longer.
    preds = {"gold": load, "silver": 2 * load, "batch": 10 * load}
    shed = [ttft_verdict(SLO, c, lambda k: preds[k.name]).shed for c in SLO.classes]
    assert shed[2] is False  # batch: never
    assert shed[:2] == sorted(shed[:2])  # False... then True...: never a higher class shed before a lower one
    assert shed[0] == (load > 1.0)  # the top class is shed exactly when no worker meets its target


def test_a_request_that_misses_its_target_even_alone_is_shed_only_for_the_queue() -> None:
    """A long prompt predicted at 3 s on an idle worker cannot meet gold's 1 s target anywhere: refusing it helps
    nobody, so it is held to QUEUE_ALLOWANCE x its own 3 s, and shed only when the queue ahead would make it wait
    longer than that."""
    gold = SLO.get("gold")
    alone = {"gold": 3.0}
    assert not ttft_verdict(SLO, gold, lambda k: 3.0, lambda k: alone.get(k.name)).shed  # idle: served
    assert not ttft_verdict(SLO, gold, lambda k: QUEUE_ALLOWANCE * 3.0, lambda k: alone.get(k.name)).shed
    v = ttft_verdict(SLO, gold, lambda k: 9.5, lambda k: alone.get(k.name))
    assert v.shed and v.retry_after_s == math.ceil(9.5 - QUEUE_ALLOWANCE * 3.0)
    # A request that fits alone keeps its class's target: queued to 1.5 s it is shed.
    assert ttft_verdict(SLO, gold, lambda k: 1.5, lambda k: 0.2).shed
