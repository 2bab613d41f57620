"""Several router processes on the fleet simulator, each blind to the others' placements but for the peers
estimate (router/decision/peers.py): how far measured TTFT strays from the prediction a request was admitted on,
and what that costs, with the estimate on and off.

    python bench/fleet_sim/router_processes.py [--span 120] [--warmup 10] [--seed 0]
        [--saturation-from EARLIER.json] [--out bench/out/fleet_sim_router_processes.json]

Three fixed fleets on the H200 worker spec (bench/fleet_sim/h200.py): one and four aggregated workers (decode
role, each prefilling its own prompts), and four prefill pods with four decode pods. Poisson arrivals, prompts 512-3072 and outputs 64-512 tokens
(uniform), TTFT target 1 s, ITL 50 ms. Each fleet's saturation is the highest rate one router process serves at
99% attainment (bisected; `--saturation-from` takes an earlier run's instead, so that two versions of the router
are compared at equal rates); the cells run at 0.85x, 1x, 1.5x and 2x of it, with 1, 2 and 4 router processes, the
peers estimate on (workers publish the prompt tokens they accepted) and off (they publish 0, which the router
reads as a worker that does not count). Every run polls on timed grids (bench/fleet_sim/fleet.py), one process
included, so that the process count is the only difference; the arrivals are the same for every cell of a rate.
One more row per rate runs one process as the simulator does by default (a load refreshed at the first arrival
a poll interval after the last: fresher snapshots), to show what the timed polls alone change.

Per cell: attainment, good requests/s, shed share, TTFT p50/p99, measured over predicted TTFT at p50/p90/p99 (the
served requests predicted or measured at a quarter of the target or more), ITL p99, and how evenly the work
spread: the most prompt tokens one prefilling worker accepted over the mean, and the same for the requests the
decode pods accepted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.fleet_sim import workload as wl  # noqa: E402
from bench.fleet_sim.fleet import Fleet, FleetConfig  # noqa: E402
from bench.fleet_sim.results import save_results  # noqa: E402
from bench.fleet_sim.scenarios import fleet_config  # noqa: E402
from planner.sizing import Counts  # noqa: E402

FLEETS = {"1 worker": Counts(decode=1), "4 workers": Counts(decode=4), "4P+4D": Counts(prefill=4, decode=4)}
RATE_FACTORS = (0.85, 1.0, 1.5, 2.0)
PROCESSES = (1, 2, 4)
PROMPT, OUTPUT = (512, 3072), (64, 512)
TTFT_S, ITL_S = 1.0, 0.05
SATURATED = 0.99  # the attainment saturation keeps
BISECT_STEPS = 6


def config(processes: int, peers: bool, seed: int, warmup: float, timed: bool = True) -> FleetConfig:
    base = fleet_config(TTFT_S, ITL_S, startup_s=60.0, seed=seed)
    return replace(
        base,
        router_processes=processes,
        timed_polls=timed,
        publish_prompt_tokens_accepted=peers,
        measure_from_s=warmup,
    )


def run_cell(
    counts: Counts, rate: float, processes: int, peers: bool, args: argparse.Namespace, timed: bool = True
) -> dict:
    reqs = wl.poisson(rate, args.span, PROMPT, OUTPUT, seed=args.seed)
    fleet = Fleet(config(processes, peers, args.seed, args.warmup, timed), counts)
    res = fleet.run(reqs, until=args.span)
    prefilling = "prefill" if counts.prefill else "decode"
    accepted = [w.prompt_tokens_accepted for w in fleet.sims.values() if w.role == prefilling]
    decodes = [w.decodes_accepted for w in fleet.sims.values() if w.role == "decode"]
    measured = sum(r.t >= args.warmup for r in reqs)
    return {
        "rate": rate,
        "processes": processes,
        "peers": peers,
        "polls": "timed" if timed else "at arrival",
        "attainment": res.attainment,
        "good_per_s": res.good / (args.span - args.warmup),
        "shed_share": res.shed / measured if measured else 0.0,
        "ttft_p50_s": res.ttft_p50_s,
        "ttft_p99_s": res.ttft_p99_s,
        "over_predicted_p50": res.ttft_over_predicted_p50,
        "over_predicted_p90": res.ttft_over_predicted_p90,
        "over_predicted_p99": res.ttft_over_predicted_p99,
        "over_predicted_n": res.ttft_over_predicted_n,
        "itl_p99_s": res.itl_p99_s,
        "prompt_spread": _spread(accepted),
        "decode_spread": _spread(decodes),
    }


def _spread(counts: list[int]) -> float:
    """The most one worker took over the mean (1: even)."""
    return max(counts) / (sum(counts) / len(counts)) if sum(counts) else 1.0


def saturation(counts: Counts, start: float, args: argparse.Namespace) -> float:
    """The highest rate one router process serves at `SATURATED` attainment or more: doubling from `start`
    until it misses, then bisected."""
    lo, hi = 0.0, start

    def holds(rate: float) -> bool:
        return run_cell(counts, rate, 1, True, args)["attainment"] >= SATURATED

    while holds(hi):
        lo, hi = hi, hi * 2
    lo = lo or hi / 2
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo


def table_row(fleet: str, c: dict) -> str:
    return (
        f"{fleet:>9} {c['rate']:6.2f} {c['processes']:2d} {c['polls']:>10} {'on' if c['peers'] else 'off':>4} "
        f"{c['attainment']:7.4f} "
        f"{c['good_per_s']:7.2f} {c['shed_share']:6.3f} {c['ttft_p50_s']:6.3f} {c['ttft_p99_s']:6.3f} "
        f"{c['over_predicted_p50']:6.2f} {c['over_predicted_p99']:6.2f} {c['itl_p99_s'] * 1e3:6.1f} "
        f"{c['prompt_spread']:6.3f} {c['decode_spread']:6.3f}"
    )


HEADER = (
    f"{'fleet':>9} {'req/s':>6} {'R':>2} {'polls':>10} {'peer':>4} {'attain':>7} {'good/s':>7} {'shed':>6} {'p50 s':>6} "
    f"{'p99 s':>6} {'m/p50':>6} {'m/p99':>6} {'ITL ms':>6} {'spread':>6} {'dspread':>6}"
)


def on_against_off(cells: list[dict]) -> list[dict]:
    """Per fleet, rate and process count: the estimate on against off."""
    timed = [c for c in cells if c["polls"] == "timed"]
    off = {(c["fleet"], c["rate"], c["processes"]): c for c in timed if not c["peers"]}
    out = []
    for on in timed:
        ref = off.get((on["fleet"], on["rate"], on["processes"]))
        if not on["peers"] or ref is None:
            continue
        out.append(
            {
                "fleet": on["fleet"],
                "rate": on["rate"],
                "processes": on["processes"],
                "good_per_s_on_over_off": on["good_per_s"] / ref["good_per_s"] if ref["good_per_s"] else None,
                "attainment_on_minus_off": on["attainment"] - ref["attainment"],
                "over_predicted_p99_on_over_off": on["over_predicted_p99"] / ref["over_predicted_p99"],
                "ttft_p99_on_over_off": on["ttft_p99_s"] / ref["ttft_p99_s"],
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--span", type=float, default=120.0, help="simulated seconds per cell")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds left out of each cell's figures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--saturation-from", type=Path, help="an earlier run's JSON: its saturations, not bisected")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "fleet_sim_router_processes.json")
    args = ap.parse_args()
    known = json.loads(args.saturation_from.read_text())["saturation_per_s"] if args.saturation_from else {}
    logging.getLogger("kvferry.router").setLevel(logging.ERROR)
    started = time.perf_counter()
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "saturation_per_s": {}, "cells": []}
    single = None
    for fleet, counts in FLEETS.items():
        hint = 2.0 if single is None else single * counts.decode * 0.9
        sat = known[fleet] if fleet in known else saturation(counts, hint, args)
        single = single or sat
        out["saturation_per_s"][fleet] = sat
        print(f"== {fleet}: saturation {sat:.2f} req/s ({time.perf_counter() - started:.0f} s)", flush=True)
        print(HEADER, flush=True)
        for factor in RATE_FACTORS:
            rate = round(sat * factor, 3)
            runs = [(1, True, False)] + [(r, peers, True) for r in PROCESSES for peers in (True, False)]
            for processes, peers, timed in runs:
                cell = run_cell(counts, rate, processes, peers, args, timed)
                cell["fleet"], cell["rate_factor"] = fleet, factor
                out["cells"].append(cell)
                print(table_row(fleet, cell), flush=True)
    out["on_against_off"] = on_against_off(out["cells"])
    print("== peers estimate on against off")
    print(f"{'fleet':>9} {'req/s':>6} {'R':>2} {'good/s':>7} {'attain':>7} {'m/p p99':>8} {'p99 TTFT':>8}")
    for r in out["on_against_off"]:
        print(
            f"{r['fleet']:>9} {r['rate']:6.2f} {r['processes']:2d} {r['good_per_s_on_over_off'] or 0:7.3f} "
            f"{r['attainment_on_minus_off']:+7.4f} {r['over_predicted_p99_on_over_off']:8.3f} "
            f"{r['ttft_p99_on_over_off']:8.3f}"
        )
    save_results(args.out, out, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
