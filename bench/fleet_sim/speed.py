"""How fast the simulator runs a large fleet: a fixed fleet of about ``--gpus`` workers under the Mooncake trace
rate-scaled to fill it, for ``--sim-s`` simulated seconds; prints the wall time one simulated hour would take
at that pace (the target: <= 600 s for 1,000 GPUs). The fleet fills up over its first seconds (decode batches
grow), and a fuller fleet costs more per request: the pace is also measured over the run's second half alone
(the difference between a run to ``--sim-s`` and one to half of it), the steady state an hour runs in.
``--route-sample`` k is the router's KVFERRY_ROUTER_SAMPLE_WORKERS: each request is scored on k workers of each
role at random plus the k holding the longest prefix of it (0: on every worker, O(fleet) per request).

    python bench/fleet_sim/speed.py [--gpus 1000] [--sim-s 60] [--route-sample 2]
    python bench/fleet_sim/speed.py --sim-s 3600 --whole-only   # the hour itself (~4 M requests)

A short run under-reads the hour: the fleet fills over its first minute (2026-12-05, 1,000 GPUs, a quiet box: a
40 s run 561-573 CPU-s per simulated hour, second half 575-617; the hour itself 700; bench/RESULTS.md). Branch
sim-speed (2194b54): the hour 581 CPU-s, 595 s wall (a busy box at first); 150 s runs interleaved with main's,
median 537 (second half 543) against 604 (627). Merged (adf0358), the hour on a quiet box: 597 CPU-s, 597.5 s wall.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.fleet_sim import workload as wl  # noqa: E402
from bench.fleet_sim.fleet import Fleet  # noqa: E402
from bench.fleet_sim.scenarios import fleet_config, fleet_spec  # noqa: E402
from planner.sizing import OfferedLoad, size_fleet  # noqa: E402


class Progress:
    """A controller that changes nothing: it says how far a long run is (every tenth of it), on stderr."""

    def __init__(self, span_s: float) -> None:
        self.interval_s = span_s / 10
        self.span_s = span_s
        self.started = time.process_time()

    def tick(self, fleet: Fleet, now: float) -> None:
        if now > 0:
            cpu = time.process_time() - self.started
            print(f"  {now:.0f} of {self.span_s:.0f} simulated s, {cpu:.0f} CPU-s", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--sim-s", type=float, default=60.0)
    ap.add_argument("--route-sample", type=int, default=2)
    ap.add_argument(
        "--whole-only",
        action="store_true",
        help="skip the run to half of --sim-s (the steady-state pace is then not measured): for a full hour",
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "fleet_sim_speed.json")
    args = ap.parse_args()
    logging.getLogger("kvferry.router").setLevel(logging.ERROR)
    trace = wl.mooncake()
    span = trace[-1].t
    cfg = replace(fleet_config(2.0, 0.05, 30.0, route_sample=args.route_sample))
    spec = fleet_spec(cfg.worker, 2.0, 0.05)
    base = OfferedLoad(
        len(trace) / span,
        statistics.mean(r.prompt for r in trace),
        statistics.mean(r.output for r in trace),
        0.0,
        statistics.mean(r.prompt * r.prompt for r in trace),
    )
    factor = 1.0
    counts = size_fleet(spec, base)  # the fleet the trace needs at its own rate
    for _ in range(4):  # the sizing is not linear in the rate: a few corrections reach --gpus
        factor *= args.gpus / counts.total()
        counts = size_fleet(spec, replace(base, rate=base.rate * factor))
    reqs = wl.scale_rate(trace, factor, args.sim_s)
    half = args.sim_s / 2
    # CPU seconds beside wall seconds: on a shared box the wall clock also counts other processes' turns.
    wall_half = cpu_half = None
    if not args.whole_only:
        started, cpu_started = time.perf_counter(), time.process_time()
        Fleet(cfg, counts).run([r for r in reqs if r.t < half], until=half)
        wall_half, cpu_half = time.perf_counter() - started, time.process_time() - cpu_started
    started, cpu_started = time.perf_counter(), time.process_time()
    res = Fleet(cfg, counts, Progress(args.sim_s) if args.whole_only else None).run(reqs, until=args.sim_s)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    hour = wall / args.sim_s * 3600
    steady = None if args.whole_only else (wall - wall_half) / (args.sim_s - half) * 3600
    cpu_steady = None if args.whole_only else (cpu - cpu_half) / (args.sim_s - half) * 3600
    out = {
        "gpus": counts.total(),
        "counts": counts.__dict__,
        "rate_req_per_s": len(reqs) / args.sim_s,
        "requests": len(reqs),
        "sim_s": args.sim_s,
        "wall_s": wall,
        "us_per_request": wall / max(len(reqs), 1) * 1e6,
        "wall_s_per_simulated_hour": hour,
        "wall_s_first_half": wall_half,
        "wall_s_per_simulated_hour_second_half": steady,
        "cpu_s": cpu,
        "cpu_s_per_simulated_hour": cpu / args.sim_s * 3600,
        "cpu_s_per_simulated_hour_second_half": cpu_steady,
        "route_sample": args.route_sample,
        "served": res.served,
        "shed": res.shed,
        "attainment": res.attainment,
        "ttft_p50_s": res.ttft_p50_s,
        "ttft_p99_s": res.ttft_p99_s,
        "itl_p99_s": res.itl_p99_s,
        "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    print(json.dumps(out, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
