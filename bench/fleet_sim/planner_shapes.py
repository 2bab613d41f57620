"""The planner on load shapes it was not tuned on: planner_eval.py's traces and scales with a shape other than its
2x / 120 s burst from mid-run (which is run too, as the control), each against the best fixed prefill:decode split
for that same load found in hindsight (planner_eval.py's search), or without it (``--no-fixed``).

    python bench/fleet_sim/planner_shapes.py mooncake:4 azure:2 [--shapes burst3x,spike4x,...] \\
        [--out bench/out/planner_shapes.json]

Each point is TRACE:SCALE as planner_scales.py's (SCALE planner_eval.py's ``--scale``; Azure runs at 4x it). The
shapes add to the trace (filled to ``--span`` at its own rate, its mean rate R) extra Poisson arrivals with lengths
drawn from the trace:

- ``burst2x``: R more for 120 s from mid-run (planner_eval.py's burst, the one the planner was tuned on);
- ``burst3x``: 2R more for 120 s from mid-run;
- ``spike4x``: 3R more for 30 s from mid-run;
- ``ramp2.5x``: from the warm-up's end, 0 rising to 1.5R over 10 minutes, then held to the end;
- ``early2x``: R more for 120 s from a quarter of the span (a shorter history behind the planner's baseline);
- ``none``: the trace alone.

Unlike planner_eval.py, whose fleets start at the sizing of the whole run's mean load (its burst included), every
fleet here starts at the planner's sizing of the trace's own mean load, the load before the shape: a ramp's mean
would hand the planner most of its peak at the start. Attainment, GPU-hours and shedding are measured after the
warm-up as planner_eval.py's; besides them: the first scale-up decision after the shape starts, the peak targets,
and the misses (counted requests not good, shed ones included) in the worst minute and from the shape's start to
a minute after its end.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.fleet_sim import workload as wl  # noqa: E402
from bench.fleet_sim.fleet import Fleet  # noqa: E402
from bench.fleet_sim.planner_eval import (  # noqa: E402
    BURST_S,
    TRACES,
    best_fixed,
    first_up_after,
    fleet_setup,
    mean_load,
    planner_fleet,
    queue_grew_after,
    summary,
    with_burst,
)
from planner.sizing import size_fleet  # noqa: E402

GOAL, RATIO = 0.99, 1.15
RAMP_S, RAMP_TO = 600.0, 2.5
PEAK = {"burst2x": 2.0, "burst3x": 3.0, "spike4x": 4.0, "ramp2.5x": RAMP_TO, "early2x": 2.0, "none": 1.0}


def shaped(shape: str, base: list, span: float, warmup: float) -> tuple[list, tuple[float, float]]:
    """`base` with `shape` added, and the shape's (start, length); the ramp's length runs to the end."""
    rate = len(base) / span
    if shape == "burst2x":  # the tuned evaluation's own burst
        return with_burst(base, span)
    if shape == "burst3x":
        at, length, extra = span * 0.5, BURST_S, 2 * rate
    elif shape == "spike4x":
        at, length, extra = span * 0.5, 30.0, 3 * rate
    elif shape == "early2x":
        at, length, extra = span * 0.25, BURST_S, rate
    elif shape == "ramp2.5x":
        return wl.ramp(base, warmup, RAMP_S, (RAMP_TO - 1) * rate, span), (warmup, span - warmup)
    elif shape == "none":
        return list(base), (span * 0.5, 0.0)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return wl.burst(base, at, length, extra), (at, length)


def misses(fleet: Fleet, reqs: list, measure_from: float) -> tuple[np.ndarray, np.ndarray]:
    """Per request: its arrival, and whether it counted and was not good (shed ones included)."""
    t = np.array([r.t for r in reqs])
    counted = (t >= measure_from) & fleet._feasible(reqs)
    return t, counted & ~np.asarray(fleet.good, dtype=bool)


def point(trace: str, scale: float, shape: str, args: argparse.Namespace) -> dict:
    load, factor, ttft = TRACES[trace]
    span = args.span
    base = wl.scale_rate(load(), scale * factor, span)
    reqs, (at, length) = shaped(shape, base, span, args.warmup)
    cfg, spec = fleet_setup(ttft, 0.05, args.startup, args.warmup)
    init = size_fleet(spec, mean_load(base, span))  # the load before the shape
    t0 = time.perf_counter()
    fleet, ctl = planner_fleet(cfg, spec, init, mean_load(base, span), args.step_reserve)
    res = fleet.run(reqs, until=span)
    wall = time.perf_counter() - t0
    t, missed = misses(fleet, reqs, args.warmup)
    minute = np.floor(t[missed] / 60).astype(int)
    worst = np.bincount(minute).max() if minute.size else 0
    worst_at = int(np.bincount(minute).argmax() * 60) if minute.size else None
    in_shape = int((missed & (t >= at) & (t < at + length + 60)).sum())
    peak = max((d.targets for d in ctl.decisions), key=lambda c: c.prefill + c.decode)
    grew = queue_grew_after(res, at)
    out = {
        "trace": trace,
        "scale": scale,
        "rate_multiplier": scale * factor,
        "shape": shape,
        "shape_at_s": at,
        "shape_length_s": length,
        "requests": len(reqs),
        "base_rate": len(base) / span,
        "start": init.__dict__,
        "planner": summary(res),
        "first_scale_up_after_start_s": first_up_after(ctl, at) if length > 0 else None,
        "queue_first_grew_after_start_s": grew if length > 0 else None,
        "peak_targets": peak.__dict__,
        "misses_worst_minute": int(worst),
        "misses_worst_minute_at_s": worst_at,
        "misses_shape_to_a_minute_after": in_shape if length > 0 else None,
        "planner_seconds": wall,
        "timeline": [
            {
                "t": tl["t"],
                "rate": round(tl["rate"], 2),
                "queue_wait_s": round(tl["queue_wait_s"], 3),
                "ready": tl["ready"],
                "targets": tl["targets"],
            }
            for tl in res.timeline
        ],
    }
    print(
        f"   {trace} x{scale * factor:g} {shape}: attainment {res.attainment:.4f}, GPU-h {res.gpu_hours:.3f}, "
        f"shed {res.shed}, first up {out['first_scale_up_after_start_s']} s, peak {peak.prefill}P+{peak.decode}D, "
        f"worst minute {worst} misses at {worst_at} s ({wall:.0f} s)",
        flush=True,
    )
    if args.fixed:
        # seeded at the sizing of the shape's peak rate (the whole run's mean leaves decode short of "generous" for
        # a spike, and the prefill search then doubles without end), and stopped past 8 times that sizing
        t0 = time.perf_counter()
        hint = size_fleet(spec, replace(mean_load(base, span), rate=len(base) / span * PEAK[shape]))
        try:
            counts, fixed, tried = best_fixed(cfg, reqs, span, hint, most=8 * max(hint.prefill, hint.decode, 2))
        except ValueError as e:
            out["fixed_best"] = {"error": str(e)}
            print(f"   fixed: {e}", flush=True)
        else:
            out["fixed_best"] = {"counts": counts.__dict__, **summary(fixed)}
            out["fixed_tried"] = tried
            out["ratio_gpu_hours_planner_over_fixed"] = res.gpu_hours / fixed.gpu_hours
            ratio = out["ratio_gpu_hours_planner_over_fixed"]
            print(f"   fixed best {counts.prefill}P+{counts.decode}D: ratio {ratio:.3f}", flush=True)
        out["fixed_seconds"] = time.perf_counter() - t0
    return out


def row(r: dict, control: dict | None) -> str:
    p = r["planner"]
    low = " (missed)" if p["attainment"] < GOAL else ""
    cells = [
        f"{r['trace'].capitalize()} x{r['rate_multiplier']:g}",
        r["shape"],
        f"{p['attainment']:.2%}{low}",
        f"{p['gpu_hours']:.3f}",
        str(p["shed"]),
        "-" if r["first_scale_up_after_start_s"] is None else f"{r['first_scale_up_after_start_s']:g}",
        f"{r['peak_targets']['prefill']}P+{r['peak_targets']['decode']}D",
        f"{r['misses_worst_minute']} at {r['misses_worst_minute_at_s']}",
    ]
    if "fixed_best" in r and "error" in r["fixed_best"]:
        cells.append("none found")
    elif "fixed_best" in r:
        f, ratio = r["fixed_best"], r["ratio_gpu_hours_planner_over_fixed"]
        high = " (missed)" if ratio > RATIO else ""
        cells.append(f"{f['counts']['prefill']}P+{f['counts']['decode']}D: {f['gpu_hours']:.3f}, {ratio:.3f}{high}")
    if control is not None:
        cells.append(f"{p['gpu_hours'] / control['planner']['gpu_hours']:.3f}")
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("points", nargs="+", help="TRACE:SCALE")
    ap.add_argument("--shapes", default="burst2x,burst3x,spike4x,ramp2.5x,early2x,none")
    ap.add_argument("--span", type=float, default=900.0)
    ap.add_argument("--warmup", type=float, default=120.0)
    ap.add_argument("--startup", type=float, default=30.0)
    ap.add_argument(
        "--step-reserve", type=float, default=1.0, help="the planner's --step-reserve (1: a doubling held ready)"
    )
    ap.add_argument("--no-fixed", dest="fixed", action="store_false", help="skip the fixed-split search")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "planner_shapes.json")
    args = ap.parse_args()
    logging.getLogger("kvferry.router").setLevel(logging.ERROR)
    started = time.perf_counter()
    rows = []
    for where in args.points:
        trace, scale = where.split(":")
        for shape in args.shapes.split(","):
            rows.append(point(trace, float(scale), shape, args))
            save(args, rows, started)  # as it goes: a long search cut short keeps the points done
    head = (
        "| trace x rate | shape | attainment | GPU-h | shed | first up, s | peak targets | worst minute's misses, at s"
    )
    head += " | fixed split in hindsight: GPU-h, planner / fixed" if args.fixed else ""
    head += " | GPU-h / the 2x burst's |"
    print(head)
    print("|" + " --- |" * head.count(" | ") + " --- |")
    for r in rows:
        same = (r["trace"], r["scale"], "burst2x")
        control = next((c for c in rows if (c["trace"], c["scale"], c["shape"]) == same), None)
        print(row(r, control) if control is not None else row(r, None)[:-1] + "| - |", flush=True)
    print(f"-> {args.out} ({save(args, rows, started):.0f} s)")
    return 0


def save(args: argparse.Namespace, rows: list[dict], started: float) -> float:
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "points": rows, "seconds": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    return out["seconds"]


if __name__ == "__main__":
    sys.exit(main())
