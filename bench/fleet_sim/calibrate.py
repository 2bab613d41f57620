"""Fits the simulator's step times to the H200 microbenchmarks, then predicts this project's recorded
single-H200 serving runs (bench/serve.py JSON) and writes predicted against measured.

    python bench/fleet_sim/calibrate.py [--runs DIR] [--share gpu_share_h200.json ...] [--slice-ms MS] [--out OUT.json]
    python bench/fleet_sim/calibrate.py --card h100 [--runs DIR] [--out OUT.json]

`--card` names the card whose microbenchmarks are fitted (roofline_CARD.json, mixed_step_CARD_graphs.json). The
H200 predicts the recorded runs below; another card predicts its own aggregated four-rate run,
serve_agg_calib_CARD.json (`bash bench/device_plan.sh 49c` records all three on whichever card comes), the
constants fitted to its lowest rate as on the H200; and where serve_pd_shared_CARD.json is there (`... 46m`: a P+D
pair and two mixed pods, each two workers time-sharing the one GPU), those too (`--share` names the card's
bench/gpu_share.py run, e.g. gpu_share_overlap_h100.json).

`--chunk-noise TRACE` gives the simulated chunk steps beside decoding the served chunk steps' errors against the
live step model, replayed from an engine step trace of the same card (`chunk_step_noise`, centred: the cost model
keeps its mean): a served step's time is not its prediction, and the ITL p99 a load gives is the tail of those
steps, more of the gaps as the load grows. Without it every step is exact and ITL p99 is one margin at every rate.

Step times: the engine's own step-time model (common/sched/step_model.py ``StepTimeModel``, its real fit) fed
the device times of bench/roofline.py (decode steps by batch and context, whole-prompt prefills) and
bench/mixed_step.py (decode batches with a prompt chunk beside them), all dummy Llama-3.1-8B bf16 on one H200.
A served step also spends host time (sampling, events, scheduling) that those device times lack, the live
model's margin differs, and a first token crosses the router: three constants fitted to one point only (the
lowest rate of serve_slo_period_h200.json: its median ITL, ITL p99 and median TTFT). Every other figure is a
prediction. Each recorded point is replayed request by request (its send times and lengths).

A prefill and a decode worker time-sharing one GPU (serve_pd_shared_h200.json) run on one simulated device
(bench/fleet_sim/device.py), three ways: shares by kernel length, a prompt step's weight against a decode step's
derived from bench/gpu_share.py's two loops on one GPU (gpu_share_h200.json; --share names others); equal shares
(what bench/fleet_sim/h200.py runs); and time slices, the slice's length from the same loops (`fit_slice_s`).
Their KV moves by a device-local copy whose fixed time and rate are fitted to bench/transfer.py's one-GPU run
(transfer_cuda_llama8b_h200.json), and lands when the prefill worker's step in flight at the first token ends
(``notice_after_step``). Every simulated engine launches each step before it processes the one before
(``launch_ahead``), as the engine does on a GPU (bench/RESULTS.md, "The engine's launch ahead in the simulator").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.fleet_sim.fleet import Fleet, FleetConfig  # noqa: E402
from bench.fleet_sim.worker import WorkerSpec  # noqa: E402
from bench.fleet_sim.workload import open_text, recorded_point  # noqa: E402
from bench.step_trace_margin import chunk_steps  # noqa: E402
from common.capacity import StepCost, chunk_attention  # noqa: E402
from common.sched.step_model import StepShape, StepTimeModel  # noqa: E402
from common.slo import parse_slo_classes  # noqa: E402
from planner.sizing import Counts  # noqa: E402
from router.decision.policy import PolicyConfig  # noqa: E402

# The recorded runs this predicts: (file, mode as recorded, what the simulated fleet is). serve_h200x2.json is
# two H200s (agg: two aggregated workers; disagg: one prefill + one decode worker) of an earlier engine.
RUNS = [
    ("serve_slo_period_h200.json", "agg", "agg"),
    ("serve_agg4_trim_h200.json", "agg", "agg"),  # the engine with the ITL trim, four rates
    ("serve_slo_deviceclock_h200.json", "agg", "agg"),
    ("serve_slo_deviceclock_h200.json", "agg@pf", "agg-prefill-first"),
    ("serve_h200x2.json", "agg", "agg2"),
    ("serve_h200x2.json", "disagg", "disagg"),
    ("serve_pd_shared_h200.json", "disagg", "disagg-shared"),  # 1 prefill + 1 decode worker on one H200
    ("serve_pd_shared_h200.json", "disagg", "disagg-shared-equal"),  # the same, equal shares (bench/fleet_sim/h200.py)
    ("serve_pd_shared_h200.json", "disagg", "disagg-shared-sliced"),  # the same, time slices (share_slice_s)
    ("serve_pd_shared_h200.json", "disagg", "disagg"),  # the same pair as if each had its GPU (what sharing adds)
]
KV_TOKENS = 55346 * 16  # the recorded agg worker's pool (pages x page size)
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # Llama-3.1-8B bf16: layers x KV heads x head dim x (K, V) x bytes
PAGE_SIZE = 16


def read_json(path: Path) -> dict:
    """A recorded run, plain or compressed (bench/out keeps the larger ones as .json.xz)."""
    with open_text(path) as f:
        return json.load(f)


def runs_for(card: str, shared_run: str | None = None) -> list[tuple[str, str, str]]:
    """The recorded runs a card's calibration predicts; the first is the one its constants are fitted to. Another
    card's are its aggregated four-rate run and, where recorded (`bash bench/device_plan.sh 46m`: two workers on
    the one GPU), its P+D pair and its two mixed pods time-sharing the GPU (`shared_run`: a later such run)."""
    if card == "h200":
        return RUNS
    shared = shared_run or f"serve_pd_shared_{card}.json"
    return [
        (f"serve_agg_calib_{card}.json", "agg", "agg"),
        (shared, "disagg", "disagg-shared-equal"),
        (shared, "disagg", "disagg-shared"),
        (shared, "disagg", "disagg-shared-sliced"),
        (shared, "mixed", "mixed-shared-equal"),
    ]


def fit_step_cost(runs: Path, card: str = "h200") -> tuple[StepCost, float]:
    """The real step-time model's fit over the microbenchmarks' points; its coefficients and residual spread."""
    model = StepTimeModel(window=1024, refit_every=1)
    roof = json.loads((runs / f"roofline_{card}.json").read_text())
    mixed = json.loads((runs / f"mixed_step_{card}_graphs.json").read_text())
    points: list[tuple[StepShape, float]] = []
    for r in roof["decode"]:
        if r.get("step_ms"):
            points.append((StepShape(0, r["batch"], r["batch"] * r["ctx"]), r["step_ms"] / 1000))
    for r in roof["prefill"]:
        n = r["tokens"]
        # one whole prompt: its chunk runs at the engine's largest step, the rest of it attends to what came before
        points.append((StepShape(n, 0, 0, chunk_attention(0, n)), r["ms"] / 1000))
    ctx = mixed["args"]["context"]
    for r in mixed["steps"]:
        b, c = r["batch"], r["chunk"]
        points.append((StepShape(c, b, b * ctx, chunk_attention(0, c)), r["mixed_ms"] / 1000))
        points.append((StepShape(c, 0, 0, chunk_attention(0, c)), r["prefill_only_ms"] / 1000))
        points.append((StepShape(0, b, b * ctx), r["decode_ms"] / 1000))
    for _ in range(4):
        for shape, seconds in points:
            model.observe(shape, seconds)
    return StepCost.from_map(model.coefficients()), model.spread_s


def chunk_step_noise(trace: Path) -> tuple[float, ...]:
    """Served chunk steps' relative errors against the live step model (`took / predicted - 1`), replayed from an
    engine step trace (KVFERRY_STEP_TRACE) as bench/step_trace_margin.py replays it, less their mean: what
    WorkerSpec.chunk_noise draws from. Not fitted to any run this predicts: a trace of another run on the card."""
    rel = [took / predicted - 1 for took, predicted, _ in chunk_steps(trace) if predicted > 0]
    mean = sum(rel) / len(rel)
    return tuple(r - mean for r in rel)


def fit_local_transfer(runs: Path) -> tuple[float, float]:
    """A device-local KV copy's fixed time and rate (tokens/s): least squares over bench/transfer.py's one-GPU
    sizes (the time from posting to the decode side's notice)."""
    sizes = json.loads((runs / "transfer_cuda_llama8b_h200.json").read_text())["sizes"]
    per_token, base = np.polyfit([r["tokens"] for r in sizes], [r["e2e_s"] for r in sizes], 1)
    return float(base), float(1 / per_token)


def fit_share_weights(paths: list[Path]) -> tuple[float, float]:
    """A prompt step's share weight against a decode step's and the exponent of a step's device time in it
    (device.py), from bench/gpu_share.py runs: a decode loop and a prompt-chunk loop on one GPU both always have
    work, so each keeps a constant share, and the ratio of the two measured is weight x (prompt step / decode
    step)**exponent, their times alone. One run gives the weight at exponent 1 (by the length of their kernels);
    runs at different chunk lengths give both (least squares of the ratio's log on the step ratio's)."""
    step_ratio, kept = [], []
    for path in paths:
        got = json.loads(path.read_text())
        decode, prefill = got["decode"], got["prefill"]
        step_ratio.append(prefill["alone_ms"]["mean"] / decode["alone_ms"]["mean"])
        kept.append(prefill["device_share"] / decode["device_share"])
    if len(set(step_ratio)) < 2:
        return float(np.mean(kept) / np.mean(step_ratio)), 1.0
    exponent, log_weight = np.polyfit(np.log(step_ratio), np.log(kept), 1)
    return float(np.exp(log_weight)), float(exponent)


def fit_slice_s(paths: list[Path]) -> float:
    """The GPU's time slice (device.py, ``share_slice_s``) from bench/gpu_share.py runs: that decode loop waits on
    each step, so its queue runs dry at every step's end and the device goes to the chunk loop, whose queue never
    does; the decode loop's next step then waits out the chunk loop's whole slice and runs alone. A shared decode
    step is its time alone plus one slice (mean over the runs)."""
    waits = []
    for path in paths:
        decode = json.loads(path.read_text())["decode"]
        waits.append(decode["shared_ms"]["mean"] - decode["alone_ms"]["mean"])
    return float(np.mean(waits)) / 1000


def kv_tokens(run: dict) -> int:
    """The run's KV pool in tokens where its workers were given KVFERRY_KV_MEMORY_GB, else the agg worker's."""
    gb = float(run["config"].get("worker_env_applied", {}).get("KVFERRY_KV_MEMORY_GB", 0) or 0)
    if gb <= 0:
        return KV_TOKENS
    return int(gb * (1 << 30)) // (KV_BYTES_PER_TOKEN * PAGE_SIZE) * PAGE_SIZE


def fleet_for(kind: str, spec: WorkerSpec, slo_ttft_ms: float, slo_itl_ms: float) -> tuple[FleetConfig, Counts]:
    slo = parse_slo_classes(f"interactive:ttft={slo_ttft_ms:g}ms,itl={slo_itl_ms:g}ms,p=99")
    if kind == "agg-prefill-first":
        spec = replace(spec, itl_target_s=0.0)
    # the router's TTFT error factor fed back, as every router process runs it (router/decision/ttft_error.py)
    cfg = FleetConfig(worker=spec, slo=slo, policy=PolicyConfig(), startup_s=0.0, error_feedback=True)
    if kind == "mixed-shared-equal":
        # bench/serve.py's mixed mode: every pod mixed, the router placing each request by its cost model
        policy = replace(cfg.policy, placement="adaptive")
        return replace(cfg, worker=_equal_shares(spec), workers_per_gpu=2, policy=policy), Counts(mixed=2)
    if kind.startswith("disagg-shared"):
        if kind == "disagg-shared-equal":
            spec = _equal_shares(spec)
        elif kind != "disagg-shared-sliced":
            spec = replace(spec, share_slice_s=0.0)
        cfg = replace(cfg, worker=spec)
        return replace(cfg, workers_per_gpu=2), Counts(prefill=1, decode=1)
    if kind == "disagg":
        return cfg, Counts(prefill=1, decode=1)
    return cfg, Counts(decode=2 if kind == "agg2" else 1)


def _equal_shares(spec: WorkerSpec) -> WorkerSpec:
    """Workers on one GPU each keep an equal share of it while both step (bench/fleet_sim/h200.py's model)."""
    return replace(spec, prefill_share_weight=1.0, share_length_exponent=0.0, share_slice_s=0.0)


def simulate_point(point: dict, cfg: FleetConfig, counts: Counts) -> dict:
    reqs = recorded_point(point)
    res = Fleet(cfg, counts).run(reqs)
    return {
        "ttft_p50_ms": res.ttft_p50_s * 1000,
        "ttft_p99_ms": res.ttft_p99_s * 1000,
        "itl_p50_ms": res.itl_p50_s * 1000,
        "itl_p99_ms": res.itl_p99_s * 1000,
        "output_tok_per_s": res.output_tok_per_s,
        "shed": res.shed,
        "good_fraction": res.attainment,
    }


def measured(point: dict) -> dict:
    return {
        "ttft_p50_ms": point["ttft_ms"]["p50"],
        "ttft_p99_ms": point["ttft_ms"]["p99"],
        "itl_p50_ms": point["itl_ms"]["p50"],
        "itl_p99_ms": point["itl_ms"]["p99"],
        "output_tok_per_s": point["output_tok_per_s"],
        "shed": point["outcomes"].get("http_429", 0),
        "good_fraction": point.get("goodput", {}).get("fraction"),
    }


def fit_peer_hop(point: dict, cfg: FleetConfig, counts: Counts) -> float:
    """A disaggregated request's path beyond the simulated hop and KV copy (FleetConfig.peer_hop_s), from a P+D
    `point` alone, by bisection on its median TTFT (a later prompt meets a different share of the GPU, so the
    median does not move by the hop alone)."""
    want = point["ttft_ms"]["p50"] / 1000
    lo, hi = 0.0, 0.2
    for _ in range(12):
        mid = (lo + hi) / 2
        got = Fleet(replace(cfg, peer_hop_s=mid), counts).run(recorded_point(point)).ttft_p50_s
        lo, hi = (mid, hi) if got < want else (lo, mid)
    return (lo + hi) / 2


def fit_host(point: dict, base: WorkerSpec, cfg_for) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """Three constants from `point` alone, each by bisection: the host time per step from its median ITL, the
    serving step model's residual spread from its ITL p99, and the time a first token spends outside the
    engine (router, HTTP, tokenizing) from its median TTFT."""
    want = point["itl_ms"]["p50"] / 1000
    lo, hi = 0.0, 0.01
    for _ in range(14):
        mid = (lo + hi) / 2
        cfg, counts = cfg_for(replace(base, host_s=mid))
        got = Fleet(cfg, counts).run(recorded_point(point)).itl_p50_s
        lo, hi = (mid, hi) if got < want else (lo, mid)
    host = (lo + hi) / 2
    # the margin the chunk budget keeps (z x the live model's residual spread) from its ITL p99
    want = point["itl_ms"]["p99"] / 1000
    lo, hi = 0.0, 0.02
    for _ in range(12):
        mid = (lo + hi) / 2
        cfg, counts = cfg_for(replace(base, host_s=host, spread_s=mid))
        got = Fleet(cfg, counts).run(recorded_point(point)).itl_p99_s
        lo, hi = (lo, mid) if got < want else (mid, hi)
    spread = (lo + hi) / 2
    cfg, counts = cfg_for(replace(base, host_s=host, spread_s=spread))
    ttft = Fleet(replace(cfg, net_s=0.0), counts).run(recorded_point(point)).ttft_p50_s
    return host, spread, max(0.0, point["ttft_ms"]["p50"] / 1000 - ttft)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=REPO / "bench" / "out")
    ap.add_argument(
        "--share", action="append", help="bench/gpu_share.py runs in --runs (repeat; default gpu_share_h200.json)"
    )
    ap.add_argument(
        "--slice-ms",
        type=float,
        default=0.0,
        help="the sliced rows' time slice, set by hand (default: fitted to --share)",
    )
    ap.add_argument(
        "--chunk-noise",
        type=Path,
        default=None,
        help="an engine step trace whose chunk steps' errors the simulated chunk steps take (default: none, exact)",
    )
    ap.add_argument(
        "--peer-hop-ms",
        type=float,
        default=None,
        help="a disaggregated request's path beyond the simulated hop and copy (default: fitted to the P+D pair "
        "on one GPU, its lowest rate; 0: none)",
    )
    ap.add_argument("--card", default="h200", help="the card whose microbenchmarks and runs are read (default h200)")
    ap.add_argument(
        "--shared-run",
        default=None,
        help="another card's P+D and mixed run on one GPU, in --runs (default serve_pd_shared_CARD.json)",
    )
    ap.add_argument("--out", type=Path, default=None, help="default bench/out/fleet_sim_calibration[_CARD].json")
    args = ap.parse_args()
    suffix = "" if args.card == "h200" else f"_{args.card}"
    out_path = args.out or REPO / "bench" / "out" / f"fleet_sim_calibration{suffix}.json"
    runs_list = runs_for(args.card, args.shared_run)
    started = time.perf_counter()
    cost, spread = fit_step_cost(args.runs, args.card)
    noise = chunk_step_noise(args.chunk_noise) if args.chunk_noise else ()
    base = WorkerSpec(
        cost=cost, spread_s=spread, kv_tokens=KV_TOKENS, chunk_noise=noise, launch_ahead=True, notice_after_step=True
    )
    first = json.loads((args.runs / runs_list[0][0]).read_text())
    ttft_ms, itl_ms = first["config"]["slo_ttft_ms"], first["config"]["slo_itl_ms"]
    host_s, served_spread, net_s = fit_host(
        first["modes"]["agg"]["points"][0], base, lambda spec: fleet_for("agg", spec, ttft_ms, itl_ms)
    )
    # the shared-GPU rows' device-local copy and shares: the H200's runs (only the H200's list has such rows)
    local_base_s, local_tokens_per_s = fit_local_transfer(args.runs)
    share_from = args.share or ["gpu_share_h200.json"]
    share_weight, share_exponent = fit_share_weights([args.runs / name for name in share_from])
    slice_s = args.slice_ms / 1000 if args.slice_ms > 0 else fit_slice_s([args.runs / name for name in share_from])
    spec = replace(
        base,
        host_s=host_s,
        spread_s=served_spread,
        local_transfer_base_s=local_base_s,
        local_transfer_tokens_per_s=local_tokens_per_s,
        prefill_share_weight=share_weight,
        share_length_exponent=share_exponent,
        share_slice_s=slice_s,
    )
    loaded = {file: read_json(args.runs / file) for file, _, _ in runs_list if (args.runs / file).exists()}

    def config(run: dict, kind: str, hop_s: float) -> tuple[FleetConfig, Counts]:
        slo = run["config"].get("slo") or {}
        run_spec = replace(spec, kv_tokens=kv_tokens(run))
        cfg, counts = fleet_for(kind, run_spec, slo.get("ttft_ms") or 1000.0, slo.get("itl_p99_ms") or 50.0)
        cfg = replace(cfg, net_s=net_s, peer_hop_s=hop_s)
        if run["config"].get("slo_ttft_ms") is None:
            cfg = replace(cfg, admit_by_ttft=False)  # runs before TTFT admission existed
        return cfg, counts

    hop_s, hop_from = (args.peer_hop_ms or 0.0) / 1000, "--peer-hop-ms"
    pair = next(((f, m) for f, m, k in runs_list if k == "disagg-shared-equal" and f in loaded), None)
    if args.peer_hop_ms is None and pair is not None:
        # a fourth constant, fitted as net_s is: the P+D pair's median TTFT at its lowest rate
        point = loaded[pair[0]]["modes"][pair[1]]["points"][0]
        hop_s = fit_peer_hop(point, *config(loaded[pair[0]], "disagg-shared-equal", 0.0))
        hop_from = f"{pair[0]} {pair[1]}, its first point (median TTFT, equal shares)"
    rows = []
    for file, mode, kind in runs_list:
        if file not in loaded or mode not in loaded[file]["modes"]:
            print(f"skipped (not here): {file} {mode}")
            continue
        run = loaded[file]
        cfg, counts = config(run, kind, hop_s)
        for point in run["modes"][mode]["points"]:
            pred, meas = simulate_point(point, cfg, counts), measured(point)
            err = {
                k: (pred[k] / meas[k] - 1) if meas.get(k) else None
                for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tok_per_s")
            }
            rows.append(
                {
                    "file": file,
                    "mode": mode,
                    "simulated": kind,
                    "rate": point.get("value"),
                    "predicted": pred,
                    "measured": meas,
                    "error": err,
                }
            )
            print(
                f"{file:32s} {kind:13s} {point.get('value')!s:>5} | TTFT p50 {pred['ttft_p50_ms']:7.0f} vs {meas['ttft_p50_ms']:7.0f}"
                f" p99 {pred['ttft_p99_ms']:7.0f} vs {meas['ttft_p99_ms']:7.0f} | ITL p99 {pred['itl_p99_ms']:6.1f} vs"
                f" {meas['itl_p99_ms']:6.1f} | out tok/s {pred['output_tok_per_s']:6.0f} vs {meas['output_tok_per_s']:6.0f}"
                f" | shed {pred['shed']} vs {meas['shed']}"
                + (f" | ITL p50 {pred['itl_p50_ms']:5.1f} vs {meas['itl_p50_ms']:5.1f}" if "shared" in kind else "")
            )
    out = {
        "step_cost": cost.as_map(),
        "microbench_spread_s": spread,
        "served_spread_s": served_spread,
        "host_s": host_s,
        "net_s": net_s,
        "local_transfer": {"base_s": local_base_s, "tokens_per_s": local_tokens_per_s},
        "prefill_share_weight": share_weight,
        "share_length_exponent": share_exponent,
        "share_slice_s": slice_s,
        "share_from": share_from,
        "card": args.card,
        "chunk_noise_from": str(args.chunk_noise.name) if args.chunk_noise else None,
        "fitted_on": f"{runs_list[0][0]} agg, its first point: host_s (median ITL), served_spread_s (ITL p99), net_s (median TTFT)",
        "peer_hop_s": hop_s,
        "peer_hop_from": hop_from,
        "points": rows,
        "seconds": time.perf_counter() - started,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=2))
    print(
        f"step cost {cost}, spread {served_spread * 1000:.2f} ms, host {host_s * 1000:.2f} ms/step, "
        f"net {net_s * 1000:.1f} ms, peer hop {hop_s * 1000:.1f} ms, local KV copy {local_base_s * 1000:.2f} ms + {local_tokens_per_s / 1e6:.2f} M "
        f"tokens/s, prompt-step share weight {share_weight:.3f} x device time ** {share_exponent:.2f}, time slice "
        f"{slice_s * 1000:.1f} ms -> {out_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
