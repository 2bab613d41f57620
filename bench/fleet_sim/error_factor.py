"""TTFT admission's error factor (router/decision/ttft_error.py) on the fleet simulator, over a load shaped like
bench/serve.py's points: what feeding served requests' measured / predicted TTFT back into admission does to
goodput and to the share of admitted requests that are good.

    python bench/fleet_sim/error_factor.py [--seed 0] [--out bench/out/fleet_sim_error_factor.json]

The simulator's worker is the model the router predicts with, so its errors are the router's own: snapshots a
poll old, other router processes' placements, a load step the polls have not seen yet (the GPU's stalls and clock
changes are not in it). Fleets: one and four aggregated workers and four prefill + four decode pods on the H200
worker spec, one and two router processes. Load: Poisson points of `POINT_S` seconds at 0.5, 1, 1.25, 1.5, 2 and 3x
the fleet's saturation (bench/out/fleet_sim_router_processes_ttft_pick.json), `GAP_S` idle between them, prompts
512-3072 and outputs 64-512, TTFT 1 s and ITL 50 ms. Each cell runs with the feedback off (the factor stays 1, as
every earlier simulated result) and on (the tracker the router runs). Per point: served, shed, good requests/s
and the admitted requests' good share; per run, the factor each process held at each point's end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.fleet_sim import workload as wl  # noqa: E402
from bench.fleet_sim.fleet import Fleet, RouterView  # noqa: E402
from bench.fleet_sim.results import save_results  # noqa: E402
from bench.fleet_sim.router_processes import FLEETS, OUTPUT, PROMPT, config  # noqa: E402
from router.decision.ttft_error import PredictionError  # noqa: E402

RATE_FACTORS = (0.5, 1.0, 1.25, 1.5, 2.0, 3.0)
POINT_S = 10.0
GAP_S = 3.0  # serve.py's drain and one-second settle between points, roughly
SATURATIONS = REPO / "bench" / "out" / "fleet_sim_router_processes_ttft_pick.json"


def workload(saturation: float, seed: int) -> tuple[list[wl.SimRequest], list[tuple[float, float]]]:
    """The points' arrivals back to back, and each point's (start, end)."""
    reqs: list[wl.SimRequest] = []
    spans = []
    t0 = 0.0
    for i, f in enumerate(RATE_FACTORS):
        part = wl.poisson(f * saturation, POINT_S, PROMPT, OUTPUT, seed=seed * 100 + i)
        reqs += [replace(r, t=r.t + t0) for r in part]
        spans.append((t0, t0 + POINT_S))
        t0 += POINT_S + GAP_S
    return reqs, spans


def run(fleet_name: str, saturation: float, processes: int, feedback: bool, seed: int) -> dict:
    reqs, spans = workload(saturation, seed)
    cfg = replace(config(processes, True, seed, 0.0), error_feedback=feedback)
    fleet = Fleet(cfg, FLEETS[fleet_name])
    held = [_factor_log(v) for v in fleet.views]
    end = spans[-1][1] + GAP_S
    fleet.run(reqs, until=end)
    points = []
    for (start, stop), f in zip(spans, RATE_FACTORS):
        idx = [i for i, r in enumerate(reqs) if start <= r.t < stop]
        shed = sum(bool(fleet.shed_mask[i]) for i in idx)
        served = len(idx) - shed
        good = sum(bool(fleet.good[i]) for i in idx)
        points.append(
            {
                "rate_factor": f,
                "rate": f * saturation,
                "requests": len(idx),
                "served": served,
                "shed": shed,
                "good_per_s": good / POINT_S,
                "admitted_good": good / served if served else 1.0,
                # the highest factor each process held while the point's requests arrived
                "factor_max": [max((f for t, f in log if start <= t < stop), default=1.0) for log in held],
            }
        )
    return {"fleet": fleet_name, "processes": processes, "feedback": feedback, "points": points}


@dataclass(slots=True)
class LoggedError(PredictionError):
    """The router's tracker, with (time, factor) after each request it observes (the factor moves only there)."""

    log: list[tuple[float, float]] = field(default_factory=list)

    def observe(self, now: float, measured_s: float, predicted_s: float | None, target_s: float | None) -> None:
        PredictionError.observe(self, now, measured_s, predicted_s, target_s)
        self.log.append((now, self.factor(now)))


def _factor_log(view: RouterView) -> list[tuple[float, float]]:
    tracker = LoggedError(view.dispatcher.ttft_error.quantile)
    view.dispatcher.ttft_error = tracker
    return tracker.log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "fleet_sim_error_factor.json")
    args = ap.parse_args()
    saturation = json.loads(SATURATIONS.read_text())["saturation_per_s"]
    started = time.perf_counter()
    cells = []
    print(f"{'fleet':>9} {'R':>2} {'fb':>3} " + " ".join(f"{f:>13}x" for f in RATE_FACTORS), flush=True)
    for name in FLEETS:
        for processes in (1, 2):
            for feedback in (False, True):
                c = run(name, saturation[name], processes, feedback, args.seed)
                cells.append(c)
                row = " ".join(f"{p['good_per_s']:6.2f} {100 * p['admitted_good']:6.2f}%" for p in c["points"])
                print(f"{name:>9} {processes:2d} {'on' if feedback else 'off':>3} {row}", flush=True)
    save_results(
        args.out,
        {"args": {k: str(v) for k, v in vars(args).items()}, "saturation_per_s": saturation, "cells": cells},
        started,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
