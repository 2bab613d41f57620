"""Simulated workers and fleets set up by hand, shared by the fleet simulator's tests."""

from __future__ import annotations

import pytest

from bench.fleet_sim.fleet import Fleet, FleetConfig
from bench.fleet_sim.worker import Job, SimWorker, WorkerSpec
from common.capacity import StepCost
from common.slo import parse_slo_classes
from planner.sizing import Counts

COST = StepCost(base_s=0.01, per_prefill_token_s=1e-4)
SLO = parse_slo_classes("interactive:ttft=1s,itl=50ms,p=99")


def shared(counts: Counts, per_gpu: int = 1, **spec_kw) -> Fleet:  # type: ignore[no-untyped-def]
    """`counts` workers at `per_gpu` to a GPU, stepping by COST with a 50 ms ITL target (`spec_kw`: the rest of
    their WorkerSpec), no start-up time and no time outside the engine."""
    spec = WorkerSpec(cost=COST, itl_target_s=0.05, transfer_tokens_per_s=200_000.0, **spec_kw)
    return Fleet(FleetConfig(worker=spec, slo=SLO, net_s=0.0, startup_s=0.0, workers_per_gpu=per_gpu), counts)


def seven_thousand_token_run(spec: WorkerSpec) -> SimWorker:
    """A prefill worker running one 7,000-token prompt alone (base 0.01 s, 1e-4 s a token, 2,048-token chunks): its
    steps end at 0.2148, 0.4296, 0.6444 (full chunks) and 0.74 (its last 856 tokens)."""
    w = SimWorker("p", "prefill", spec, lambda *_: None, lambda *_: None, lambda *_: None)
    w.add(Job(0, 0.0, 7000, 7000, 0, 7000), 0.0)
    assert w.wake(0.0) == pytest.approx(0.74)
    return w
