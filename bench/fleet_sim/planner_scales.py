"""The planner alone at several trace scales, against the best fixed split that planner_eval.py found for each:
the same requests, burst, SLOs, start and warm-up as planner_eval.py's, without its fixed-split search and HPA
runs (minutes at the larger scales; they do not depend on the planner's code, so one planner_eval.py run per
scale serves every version of the planner).

    python bench/fleet_sim/planner_scales.py mooncake:4=bench/out/planner_eval_reserve_mooncake.json \\
        azure:2=bench/out/planner_eval_azure_x8.json [--out bench/out/planner_scales.json]

Each point is TRACE:SCALE=JSON, TRACE mooncake or azure and SCALE planner_eval.py's ``--scale`` (Azure runs at
4x it), JSON a planner_eval.py output for that trace and scale (its ``fixed_best``). Besides attainment and the
GPU-hours against the fixed split it reports the first scale-up decision after the burst starts and after the
queue first grew (the first decision in the burst that read a predicted wait above 0), and how often a reading
outside the burst (after the warm-up) has a wait above 0: where that is common, the first one in the burst need
not be the burst's.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.fleet_sim.planner_eval import (  # noqa: E402
    TRACES,
    first_up_after,
    fleet_setup,
    mean_load,
    queue_grew_after,
    run_planner,
    summary,
    trace_requests,
)
from planner.sizing import size_fleet  # noqa: E402

GOAL, RATIO = 0.99, 1.15


def point(trace: str, scale: float, fixed_json: Path, args: argparse.Namespace) -> dict:
    _, factor, ttft = TRACES[trace]
    span = args.span
    reqs, burst = trace_requests(trace, scale, span)  # as planner_eval.py's, the burst included
    cfg, spec = fleet_setup(ttft, 0.05, args.startup, args.warmup)
    t = time.perf_counter()
    res, ctl = run_planner(cfg, spec, reqs, span, size_fleet(spec, mean_load(reqs, span)))
    fixed = json.loads(fixed_json.read_text())[trace]["fixed_best"]
    grew = queue_grew_after(res, burst[0])
    up = first_up_after(ctl, burst[0])
    outside = [tl for tl in res.timeline if tl["t"] >= args.warmup and not burst[0] <= tl["t"] < sum(burst)]
    return {
        "trace": trace,
        "scale": scale,
        "rate_multiplier": scale * factor,
        "planner": summary(res),
        "fixed_best": fixed,
        "ratio_gpu_hours_planner_over_fixed": res.gpu_hours / fixed["gpu_hours"],
        "first_scale_up_after_burst_s": up,
        "queue_first_grew_after_burst_s": grew,
        "reaction_after_queue_grew_s": None if grew is None or up is None else up - grew,
        "queue_nonzero_share_outside_burst": sum(tl["queue_wait_s"] > 0 for tl in outside) / max(len(outside), 1),
        "seconds": time.perf_counter() - t,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("points", nargs="+", help="TRACE:SCALE=planner_eval.json")
    ap.add_argument("--span", type=float, default=900.0)
    ap.add_argument("--warmup", type=float, default=120.0)
    ap.add_argument("--startup", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "planner_scales.json")
    args = ap.parse_args()
    logging.getLogger("kvferry.router").setLevel(logging.ERROR)
    rows = []
    print(
        "| trace x rate | attainment | GPU-h | fixed split: GPU-h | ratio | first up after burst / queue grew "
        "| reaction | waits > 0 outside the burst |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for spec in args.points:
        where, fixed_json = spec.split("=", 1)
        trace, scale = where.split(":")
        r = point(trace, float(scale), Path(fixed_json), args)
        rows.append(r)
        p, f, ratio = r["planner"], r["fixed_best"], r["ratio_gpu_hours_planner_over_fixed"]
        low = " (missed)" if p["attainment"] < GOAL else ""
        high = " (missed)" if ratio > RATIO else ""
        counts = f"{f['counts']['prefill']}P+{f['counts']['decode']}D"
        print(
            f"| {trace} x{r['rate_multiplier']:g} | {p['attainment']:.2%}{low} | {p['gpu_hours']:.3f} | {counts}: "
            f"{f['gpu_hours']:.3f} | {ratio:.3f}{high} | {r['first_scale_up_after_burst_s']} / "
            f"{r['queue_first_grew_after_burst_s']} s | {r['reaction_after_queue_grew_s']} s | "
            f"{r['queue_nonzero_share_outside_burst']:.1%} |",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "points": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
