"""The fleet configurations the planner evaluation runs: one H200 Llama-8B worker type, the SLOs per trace."""

from __future__ import annotations

from dataclasses import replace

from bench.fleet_sim.fleet import FleetConfig
from bench.fleet_sim.h200 import H200_LLAMA8B, NET_S
from bench.fleet_sim.worker import WorkerSpec
from common.slo import parse_slo_classes
from planner.core import PlannerConfig
from planner.sizing import Counts, FleetSpec

__all__ = ["fleet_config", "fleet_spec"]


def fleet_config(ttft_s: float, itl_s: float, startup_s: float, route_sample: int = 0, seed: int = 0) -> FleetConfig:
    slo = parse_slo_classes(f"interactive:ttft={ttft_s:g}s,itl={itl_s * 1000:g}ms,p=99")
    worker = replace(H200_LLAMA8B, itl_target_s=itl_s)
    return FleetConfig(worker=worker, slo=slo, startup_s=startup_s, route_sample=route_sample, net_s=NET_S, seed=seed)


def fleet_spec(worker: WorkerSpec, ttft_s: float, itl_s: float) -> FleetSpec:
    """What the planner knows of the fleet: the coefficients each worker publishes, its limits, the SLOs."""
    return FleetSpec(
        cost=worker.published,
        ttft_s=ttft_s,
        itl_s=itl_s,
        chunk_tokens=worker.max_prefill_tokens,
        max_running=worker.max_running,
        kv_tokens=worker.kv_tokens,
        transfer_tokens_per_s=worker.transfer_tokens_per_s,
        roles=("prefill", "decode"),
        min_workers=Counts(1, 1, 0),
    )


def planner_config(startup_s: float, step_reserve: float = 1.0) -> PlannerConfig:
    # the step held in reserve is the burst the targets name (the rate doubles at once); no signal seen
    # before it (the traces' own swings of the rate) foretells it, so it is the operator's stated risk
    return PlannerConfig(horizon_s=startup_s, step_reserve=step_reserve)
