"""The planner on the fleet simulator against a fixed prefill:decode split chosen in hindsight and one HPA per
role on utilisation, on the Mooncake and Azure traces with a burst added, and on the load swing of Dynamo's
issue #10528 (1 <-> 24 req/s, 8,000-token prompts, 1,000-token outputs, TTFT target 3 s).

    python bench/fleet_sim/planner_eval.py [--scale 4] [--span 900] [--out bench/out/planner_eval.json]
    python bench/fleet_sim/planner_eval.py --only none --trace my_trace.jsonl --trace-scale 2 --ttft-s 1.5

``--trace`` evaluates another trace the same way (repeatable): JSON lines with Mooncake's fields (its tool-agent
and synthetic traces too) or CSV with Azure's or BurstGPT's columns, `.xz` / `.gz` read compressed
(bench/fleet_sim/workload.py ``trace_file``); its rate times ``--trace-scale``, repeated to fill ``--span``, the
burst added, at the ``--ttft-s`` / ``--itl-s`` targets.

Every fleet starts at the planner's sizing of the trace's mean load and is measured after a warm-up
(``--warmup``, the same for all); a request counts when an idle worker could serve it within the targets
(Mooncake's longest prompts cannot be prefilled within 2 s by one GPU at all: reported as infeasible).
Attainment: requests within both SLOs (shed ones are not) over those counted. GPU-hours: every pod from
the moment it is asked for until it has drained. The fixed split in hindsight: the fewest prefill workers
that reach 99% with decode generous, then the fewest decode workers with that many prefill. The HPA: the
utilisation target, among 0.5 / 0.7 / 0.9, with the fewest GPU-hours at the planner's attainment or above.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.fleet_sim import workload as wl  # noqa: E402
from bench.fleet_sim.controllers import HpaController, PlannerController  # noqa: E402
from bench.fleet_sim.fleet import Fleet, FleetConfig, Result  # noqa: E402
from bench.fleet_sim.results import save_results  # noqa: E402
from bench.fleet_sim.scenarios import fleet_config, fleet_spec, planner_config  # noqa: E402
from planner.core import Planner  # noqa: E402
from planner.sizing import Counts, FleetSpec, OfferedLoad, size_fleet  # noqa: E402

GOAL = 0.99


def mean_load(reqs: list[wl.SimRequest], span: float) -> OfferedLoad:
    return OfferedLoad(
        len(reqs) / span,
        statistics.mean(r.prompt for r in reqs),
        statistics.mean(r.output for r in reqs),
        0.0,
        statistics.mean(r.prompt * r.prompt for r in reqs),
    )


def planner_fleet(
    cfg: FleetConfig, spec: FleetSpec, init: Counts, known: OfferedLoad, step_reserve: float = 1.0
) -> tuple[Fleet, PlannerController]:
    """A fleet of `init` sized by the planner, which starts knowing the load `known`."""
    ctl = PlannerController(Planner(spec, planner_config(cfg.startup_s, step_reserve)), known)
    ctl.planner.targets = init
    return Fleet(cfg, init, ctl), ctl


def run_planner(
    cfg: FleetConfig, spec: FleetSpec, reqs: list, span: float, init: Counts
) -> tuple[Result, PlannerController]:
    fleet, ctl = planner_fleet(cfg, spec, init, mean_load(reqs, span))
    return fleet.run(reqs, until=span), ctl


def run_fixed(cfg: FleetConfig, reqs: list, span: float, counts: Counts) -> Result:
    return Fleet(cfg, counts).run(reqs, until=span)


def best_fixed(
    cfg: FleetConfig, reqs: list, span: float, hint: Counts, most: int | None = None
) -> tuple[Counts, Result, list[dict]]:
    """The cheapest fixed split reaching GOAL: fewest prefill with decode generous, then fewest decode. With `most`,
    a search whose doubling passes that many workers of a role without reaching GOAL raises ValueError."""
    tried: list[dict] = []

    def attempt(c: Counts) -> Result:
        r = run_fixed(cfg, reqs, span, c)
        tried.append({"counts": c.__dict__, "attainment": r.attainment, "gpu_hours": r.gpu_hours})
        print(f"   fixed {c.prefill}P+{c.decode}D: attainment {r.attainment:.4f}, GPU-h {r.gpu_hours:.2f}", flush=True)
        return r

    def least(lo: int, hi: int, make) -> int:  # type: ignore[no-untyped-def]
        while attempt(make(hi)).attainment < GOAL:
            if most is not None and hi >= most:
                raise ValueError(f"no fixed split with at most {most} workers of a role reaches {GOAL}")
            lo, hi = hi, hi * 2
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if attempt(make(mid)).attainment >= GOAL else (mid, hi)
        return hi

    generous = max(2, hint.decode * 2)
    p = least(max(0, hint.prefill // 2), max(1, hint.prefill * 2), lambda n: Counts(n, generous))
    d = least(max(0, hint.decode // 3), generous, lambda n: Counts(p, n))
    best = Counts(p, d)
    return best, run_fixed(cfg, reqs, span, best), tried


def run_hpa(cfg: FleetConfig, reqs: list, span: float, init: Counts, target: float) -> Result:
    return Fleet(cfg, init, HpaController(target=target)).run(reqs, until=span)


def first_up_after(ctl: PlannerController, t0: float) -> float | None:
    for d in ctl.decisions:
        if d.t >= t0 and any(r.startswith("up") for r in d.reasons.values()):
            return d.t - t0
    return None


def queue_grew_after(res: Result, t0: float) -> float | None:
    """Seconds from `t0` to the first reading from then on with a predicted queue wait above 0."""
    return next((tl["t"] - t0 for tl in res.timeline if tl["t"] >= t0 and tl["queue_wait_s"] > 0), None)


def summary(r: Result) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.summary().items()}


# The evaluated traces: loader, rate multiplier per --scale (Azure's trace is 4x thinner), TTFT target (s).
TRACES = {"mooncake": (wl.mooncake, 1.0, 2.0), "azure": (wl.azure, 4.0, 1.0)}
BURST_S = 120.0  # how long the evaluation's burst doubles the trace's mean rate, from mid-run


def with_burst(base: list, span: float) -> tuple[list, tuple[float, float]]:
    """`base` with the evaluation's burst added, and the burst (start, length)."""
    burst = (span * 0.5, BURST_S)
    return wl.burst(base, burst[0], burst[1], len(base) / span), burst


def trace_requests(trace: str, scale: float, span: float) -> tuple[list, tuple[float, float]]:
    """One of `TRACES` at `scale`, filling `span`, with the burst."""
    load, factor, _ = TRACES[trace]
    return with_burst(wl.scale_rate(load(), scale * factor, span), span)


def fleet_setup(ttft: float, itl: float, startup: float, warmup: float, route_sample: int = 0) -> tuple:
    """The simulated fleet's configuration and the planner's spec at these targets, measured from `warmup`."""
    cfg = replace(fleet_config(ttft, itl, startup, route_sample=route_sample), measure_from_s=warmup)
    return cfg, fleet_spec(cfg.worker, ttft, itl)


def evaluate(name: str, reqs: list, span: float, ttft: float, itl: float, burst: tuple[float, float], args) -> dict:  # type: ignore[no-untyped-def]
    cfg, spec = fleet_setup(ttft, itl, args.startup, args.warmup, args.route_sample)
    init = size_fleet(spec, mean_load(reqs, span))
    print(f"== {name}: {len(reqs)} requests over {span:.0f} s ({len(reqs) / span:.1f} req/s), start {init}", flush=True)
    t = time.perf_counter()
    plan, ctl = run_planner(cfg, spec, reqs, span, init)
    print(
        f"   planner: attainment {plan.attainment:.4f}, GPU-h {plan.gpu_hours:.2f} ({time.perf_counter() - t:.0f} s)",
        flush=True,
    )
    up = first_up_after(ctl, burst[0])
    fixed_counts, fixed, tried = best_fixed(cfg, reqs, span, init)
    hpas = {}
    for target in (0.5, 0.7, 0.9):
        hpas[target] = run_hpa(cfg, reqs, span, init, target)
        print(
            f"   HPA @{target}: attainment {hpas[target].attainment:.4f}, GPU-h {hpas[target].gpu_hours:.2f}",
            flush=True,
        )
    at_par = [t for t, r in hpas.items() if r.attainment >= plan.attainment - 1e-9]
    hpa_t = min(at_par, key=lambda t: hpas[t].gpu_hours) if at_par else max(hpas, key=lambda t: hpas[t].attainment)
    out = {
        "requests": len(reqs),
        "span_s": span,
        "slo": {"ttft_s": ttft, "itl_s": itl},
        "burst": {"at_s": burst[0], "length_s": burst[1]},
        "planner": summary(plan),
        "first_scale_up_after_burst_s": up,
        "fixed_best": {"counts": fixed_counts.__dict__, **summary(fixed)},
        "fixed_tried": tried,
        "hpa": {str(t): summary(r) for t, r in hpas.items()},
        "hpa_chosen_target": hpa_t,
        "ratio_gpu_hours_planner_over_fixed": plan.gpu_hours / fixed.gpu_hours,
        "ratio_gpu_hours_planner_over_hpa": plan.gpu_hours / hpas[hpa_t].gpu_hours,
        "timeline": ctl.decisions
        and [
            {"t": d.t, "targets": d.targets.__dict__, "rate": tl.get("rate"), "queue_wait_s": tl.get("queue_wait_s")}
            for d, tl in zip(ctl.decisions, plan.timeline)
        ],
    }
    print(
        f"   planner/fixed GPU-h {out['ratio_gpu_hours_planner_over_fixed']:.3f} (target <= 1.15), planner/HPA "
        f"{out['ratio_gpu_hours_planner_over_hpa']:.3f} (target <= 0.75), first scale-up {up} s after the burst",
        flush=True,
    )
    return out


def dynamo_swing(args) -> dict:  # type: ignore[no-untyped-def]
    """Dynamo #10528's load: 1 <-> 24 req/s, 8,000 / 1,000 tokens, TTFT 3 s; the planner alone."""
    span, period = args.span, 300.0
    reqs = wl.swing(1.0, 24.0, period, span, 8000, 1000, seed=3)
    ttft, itl = 3.0, 0.05
    cfg, spec = fleet_setup(ttft, itl, args.startup, 0.0, args.route_sample)
    init = size_fleet(spec, OfferedLoad(1.0, 8000, 1000))
    t = time.perf_counter()
    res, ctl = run_planner(cfg, spec, reqs, span, init)
    print(
        f"== Dynamo #10528 swing: attainment {res.attainment:.4f} (target >= 0.80), GPU-h {res.gpu_hours:.2f}, "
        f"p99 TTFT {res.ttft_p99_s:.2f} s ({time.perf_counter() - t:.0f} s)",
        flush=True,
    )
    return {
        "requests": len(reqs),
        "span_s": span,
        "period_s": period,
        "planner": summary(res),
        "timeline": [
            {
                "t": d.t,
                "targets": d.targets.__dict__,
                "ready": tl["ready"],
                "rate": tl["rate"],
                "queue_wait_s": tl["queue_wait_s"],
            }
            for d, tl in zip(ctl.decisions, res.timeline)
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=4.0, help="trace rate multiplier")
    ap.add_argument("--span", type=float, default=900.0, help="simulated seconds")
    ap.add_argument("--warmup", type=float, default=120.0)
    ap.add_argument("--startup", type=float, default=30.0, help="a new pod's seconds to ready")
    ap.add_argument("--route-sample", type=int, default=0)
    ap.add_argument("--only", default="mooncake,azure,dynamo", help="of mooncake, azure, dynamo (none: --trace only)")
    ap.add_argument("--trace", type=Path, action="append", default=[], help="another trace file to evaluate")
    ap.add_argument("--trace-scale", type=float, default=1.0, help="--trace's rate multiplier")
    ap.add_argument("--ttft-s", type=float, default=2.0, help="--trace's TTFT target")
    ap.add_argument("--itl-s", type=float, default=0.05, help="--trace's ITL target (its p99)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "planner_eval.json")
    args = ap.parse_args()
    logging.getLogger("kvferry.router").setLevel(logging.ERROR)
    started = time.perf_counter()
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    only = args.only.split(",")
    for trace, name in (("mooncake", "Mooncake + burst"), ("azure", "Azure + burst")):
        if trace in only:
            reqs, burst = trace_requests(trace, args.scale, args.span)
            out[trace] = evaluate(name, reqs, args.span, TRACES[trace][2], 0.05, burst, args)
    if "dynamo" in only:
        out["dynamo_10528"] = dynamo_swing(args)
    for path in args.trace:
        reqs, burst = with_burst(wl.scale_rate(wl.trace_file(path), args.trace_scale, args.span), args.span)
        out[path.name] = evaluate(f"{path.name} + burst", reqs, args.span, args.ttft_s, args.itl_s, burst, args)
    save_results(args.out, out, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
