"""Serving benchmark: the whole system as pods run it, from HTTP request to streamed token.

    python bench/serve.py --mode disagg --rates 1,2 --num 8 --prompt-len 32-128 --output-len 8-32   # CPU
    python bench/serve.py --mode agg,disagg --gpus 0,1 --model dummy:llama-3.1-8b --rates 8,16,24,40 \
        --num 200 --offline --worker-env KVFERRY_KV_MEMORY_GB=100                                      # 2 GPUs
    python bench/serve.py --url http://127.0.0.1:8000 --model dummy:llama-3.1-8b --concurrency 1,16,64
    python bench/serve.py --mode agg,agg@old --variant-env old:KVFERRY_ITL_TARGET_MS=0 --gpus 0 \
        --model dummy:llama-3.1-8b --rates 7,11                          # one mode, two settings, one run
    python bench/serve.py --plot-only bench/out/serve_X.json

For each mode it starts a deployment (bench/serve_deploy.py: redis-server, workers and a router as
separate `kvferry` processes configured by KVFERRY_* env vars; `--gpus` gives each worker one GPU,
`--gpus 0,0` two workers one GPU; `--worker-env K=V` adds a worker setting, e.g. the KV pool size,
whose 1 GB default suits the CPU; a mode written `MODE@NAME` runs MODE with the extra worker settings
`--variant-env NAME:K=V` gives; `KVFERRY_ROUTER_*` keys go to that variant's router, the rest to its workers, so two policies are measured in one run), or targets a running one (`--url`), warms it up, and runs every
load point: Poisson arrivals at each `--rates` value and a closed loop at each `--concurrency` value,
`--num` requests per point. Prompts are random token ids and outputs exact (`ignore_eos`), lengths uniform in `--prompt-len` / `--output-len`;
each point has its own prompts (no prefix-cache hits across points) and the modes get the same ones.

The router's tokenizer is a synthetic word-level one (bench/synthetic_tokenizer.py: id i <-> "t<i>", the
model's vocabulary size), so the client counts every streamed token exactly; a `--url` deployment should
be started with one too (else tokens are counted one per SSE event, and the JSON says so).

Per point: TTFT, ITL (every gap between consecutive tokens as the client saw them), TPOT, end-to-end
(p50/p90/p99), output tok/s, goodput at the SLOs (`--slo-ttft-ms`, `--slo-itl-ms`: a request is good when
it completes, its TTFT is within the first and the p99 of its own ITLs within the second), and with
`--class-mix interactive:0.5,batch:0.5` (each request sent with that `x-kvferry-class`) per SLO class its
requests, 429s, TTFT / ITL attainment, good requests and goodput against the class's own targets
(`--slo-classes`, else the deployment's defaults), HTTP outcomes,
whether tokens arrived in bursts and who grouped them, and the client's own load (CPU, event-loop lag,
send lateness). Where the time went: the router's TTFT predictions against what it measured and the average
request's stage offsets across router and workers (bench/serve_predictions.py), each worker's stage means over
the point (bench/serve_phases.py), and per request its longest gap, the token it followed and when it ended.
`--offline` first runs the offline engine on one device with the first point's workload
(bench/serve_offline.py, its own process) and reports served / (offline x devices) for each mode.

Writes bench/out/serve_<model>_<time>.json (or `--out`) after every point, and PNG plots beside it when
matplotlib is importable (bench/serve_plot.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
if __package__ in (None, ""):
    sys.path.insert(0, str(BENCH_DIR.parent))

from serve_deploy import DeployError, Deployment, DeploySpec, get_json, settle_logs, start_deployment  # noqa: E402
from serve_load import Arrivals, LoadClient, TokenRange, make_workload, run_point  # noqa: E402
from serve_metrics import SLO, parse_class_slos, summarize_point  # noqa: E402
from serve_phases import SLOW_SUFFIX, phase_means, read_totals  # noqa: E402
from serve_predictions import gather_predictions  # noqa: E402
from synthetic_tokenizer import build_word_tokenizer, count_words  # noqa: E402

from common.settings_registry import REGISTRY  # noqa: E402
from common.slo import DEFAULT_SLO_SPEC  # noqa: E402

OUT_DIR = BENCH_DIR / "out"
DEFAULT_MODEL = "smollm2-135m-instruct"
# The router's placement reasons (router/decision/policy.py) for a decode worker prefilling the prompt itself.
LOCAL_PREFILL_DECISIONS = ("short-prompt", "decode-holds-prefix", "no-prefill")


def say(msg: str) -> None:
    print(msg, flush=True)


# ---- setup ---------------------------------------------------------------------------------------------
def model_shape(model: str) -> tuple[int, int]:
    """(vocab size, context length) of the served model, without loading torch."""
    if model.startswith("dummy:"):
        from common.engine.named_configs import NAMED_CONFIGS

        name = model.split(":", 1)[1]
        if name not in NAMED_CONFIGS:
            raise SystemExit(f"unknown dummy config {name!r}; known: {', '.join(NAMED_CONFIGS)}")
        cfg: dict[str, Any] = NAMED_CONFIGS[name]
    else:
        from common.default_model import resolve_model_path

        cfg = json.loads((Path(resolve_model_path(model)) / "config.json").read_text())
    return int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 4096))


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"bad KEY=VALUE: {pair!r}")
        env[key] = value
    return env


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def host_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
            info["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def point_list(args: argparse.Namespace) -> list[Arrivals]:
    points = [Arrivals("rate", float(v)) for v in args.rates.split(",") if v.strip()] if args.rates else []
    if args.concurrency:
        points += [Arrivals("concurrency", float(int(v))) for v in args.concurrency.split(",") if v.strip()]
    return points


# ---- offline ceiling -----------------------------------------------------------------------------------
def run_offline(args: argparse.Namespace, vocab: int, worker_env: dict[str, str], log_dir: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if args.gpus:
        env["CUDA_VISIBLE_DEVICES"] = args.gpus[0]
        env["KVFERRY_DEVICE"] = "cuda"
    env.update(worker_env)
    out = log_dir / "offline.json"
    log = log_dir / "offline.log"
    cmd = [
        sys.executable,
        str(BENCH_DIR / "serve_offline.py"),
        *("--model", args.model, "--num", str(args.num), "--vocab", str(vocab), "--out", str(out)),
        *(
            "--prompt-len",
            str(args.prompt_len),
            "--output-len",
            str(args.output_len),
            "--seed",
            str(point_seed(args, 0)),
        ),
    ]
    say(f"offline engine: {args.num} requests on {'GPU ' + args.gpus[0] if args.gpus else 'the CPU'}")
    with open(log, "wb") as f:
        try:
            rc = subprocess.run(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.offline_timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        say(f"offline run failed (rc {rc}, log {log}):\n{tail}")
        return {"error": f"rc {rc}", "log_tail": tail}
    res = json.loads(out.read_text())
    say(
        f"offline engine: {res['output_tok_per_s']:.0f} output tok/s ({res['total_tok_per_s']:.0f} total), "
        f"{res['wall_s']:.1f} s"
    )
    return res


def point_seed(args: argparse.Namespace, index: int) -> int:
    return args.seed * 1000 + index


# ---- one mode ------------------------------------------------------------------------------------------
def slow_collections(phases: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Each process's slow garbage collections over the point (bench/serve_phases.py), where any."""
    return {
        f"{name} {phase.removesuffix(SLOW_SUFFIX)}": v["n"]
        for name, by_phase in phases.items()
        for phase, v in by_phase.items()
        if phase.endswith(SLOW_SUFFIX)
    }


def prediction_line(p: dict[str, Any]) -> str:
    """The router's measured / predicted TTFT by predicted bucket, and each process's error factor."""
    parts = [
        f"<{b['predicted_ms'][1] or 'inf'} ms n={b['n']} {b['ratio']['p50']}/{b['ratio']['p99']}"
        for b in p["by_predicted"]
    ]
    paths = [f"{k} n={v['n']} {v['excess_ms']['p50']}" for k, v in p.get("by_decision", {}).items()]
    line = f"    predictions (measured/predicted p50/p99): {'; '.join(parts) or '-'}; factors {p['factors']}"
    if paths:
        line += f"\n    measured - predicted p50 ms by decision: {'; '.join(paths)}; remote excess s {p.get('remote_excess_s')}"
    return line


def progress_line(mode: str, arrivals: Arrivals, s: dict[str, Any]) -> str:
    o = s["outcomes"]
    bad = {k: v for k, v in o.items() if k != "ok"}
    return (
        f"{mode:>6} {arrivals.label:>15}: {s['completed']}/{s['requests']} ok"
        + (f" {bad}" if bad else "")
        + f", {s['output_tok_per_s']:.0f} out tok/s, TTFT p50/p99 {s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms"
        + f", ITL p50/p99 {s['itl_ms']['p50']:.1f}/{s['itl_ms']['p99']:.1f} ms"
        + f", TPOT p50 {s['tpot_ms']['p50']:.1f} ms, goodput {s['goodput']['fraction']:.2f}"
        + f", bursts {s['bursts']['frac_tokens_in_multi_event_reads'] + s['bursts']['frac_tokens_in_multi_token_events']:.2f}"
        + f", client cpu {s['client']['cpu_fraction']:.2f} ({s['wall_s']:.1f} s)"
        + f", admitted good {s['goodput']['admitted_fraction']:.3f}"
        + (
            f", shared gaps {len(s['shared_gaps'])} (longest {max(g['gap_ms'] for g in s['shared_gaps']):.0f} ms)"
            if s.get("shared_gaps")
            else ""
        )
        + "".join(
            f"; {name}: good {c['good']}/{c['requests']} ({c['goodput_request_per_s']:.2f}/s), shed {c['shed_429']}"
            for name, c in s.get("classes", {}).items()
        )
    )


async def bench_mode(
    mode: str,
    url: str,
    args: argparse.Namespace,
    vocab: int,
    slo: SLO,
    deployment: Deployment | None,
    record: dict[str, Any],
    save: Any,
) -> None:
    points = point_list(args)
    worker_urls = {p.name: p.url for p in deployment.workers} if deployment is not None else {}
    async with LoadClient(url, args.request_timeout) as client:
        record["client_backend"] = client.backend
        # Warm-up on prompts of the longest length (lazy kernels, the P/D handshake) that no point reuses.
        warm = make_workload(
            args.warmup,
            TokenRange(args.prompt_len.hi, args.prompt_len.hi),
            TokenRange(args.output_len.lo, args.output_len.lo),
            vocab,
            10_000_000 + args.seed,
            args.model,
        )
        client.count_tokens = count_words
        if warm:
            run = await run_point(client, warm, Arrivals("rate", float("inf")), 0, args.drain_timeout)
            if any(r.outcome != "ok" for r in run.records):
                raise DeployError(f"warm-up failed: {[(r.outcome, r.http_status, r.error) for r in run.records]}")
            if any(r.usage_tokens not in (None, r.tokens) for r in run.records):
                say(
                    f"{mode}: the router's tokenizer is not bench/synthetic_tokenizer.py's; counting one token per event"
                )
                client.count_tokens = _one_per_event
        record["token_count"] = "words" if client.count_tokens is count_words else "events"
        local = sent = 0  # requests the router had the decode worker prefill; requests sent
        for index, arrivals in enumerate(points):
            count = point_requests(args, arrivals)
            sent += count
            items = make_workload(
                count,
                args.prompt_len,
                args.output_len,
                vocab,
                point_seed(args, index),
                args.model,
                args.class_mix,
            )
            phase_urls = {**worker_urls, "router": url}  # the router's for its collections
            phases_before = read_totals(phase_urls)
            started_wall = time.time()
            run = await run_point(
                client, items, arrivals, point_seed(args, index), args.drain_timeout, retry_429=args.retry_429
            )
            summary = summarize_point(run, slo, parse_class_slos(args.slo_classes or DEFAULT_SLO_SPEC))
            # value inf (all at once) is stored as null: the label keeps it readable
            summary.update(kind=arrivals.kind, value=arrivals.value, label=arrivals.label, seed=point_seed(args, index))
            # wall clock at the point's start (within a ms of its requests' zero): lines up a request's
            # `max_gap_end_ms` with the workers' step traces (KVFERRY_STEP_TRACE lines' "t") and logs
            summary["started_at"] = round(started_wall, 3)
            phases = phase_means(phases_before, read_totals(phase_urls))
            summary["router_decisions"] = {
                k.removeprefix("decision_"): v["n"]
                for k, v in phases.get("router", {}).items()
                if k.startswith("decision_")
            }
            summary["ttft_predictions"] = gather_predictions(url, started_wall, count)
            summary["worker_phases"] = phases
            record["points"].append(summary)
            save()
            say(progress_line(mode, arrivals, summary))
            say(prediction_line(summary["ttft_predictions"]))
            slow = slow_collections(phases)
            if slow:
                say(f"    collections of 30 ms or more: {slow}")
            for phase, what in (
                ("slow_steps_stall", "steps past the ITL target on a host stall"),
                ("alloc_retries", "device allocator retries (each a host stall)"),
            ):
                counted = {k: v[phase]["n"] for k, v in phases.items() if phase in v}
                if counted:
                    say(f"    {what}: {counted}")
            local += sum(summary["router_decisions"].get(k, 0) for k in LOCAL_PREFILL_DECISIONS)
            if deployment is not None and deployment.dead_parts():
                dead = deployment.dead_parts()
                raise DeployError(f"{', '.join(p.name for p in dead)} died:\n{deployment.describe_failure(dead)}")
            await asyncio.sleep(1.0)  # let the router's load view settle before the next point
        if mode == "disagg" and local:
            say(
                f"{mode}: {local} of {sent} requests were prefilled on the decode worker (see "
                "router_decisions; prompts shorter than the router's disagg_min_prompt_tokens stay local)"
            )


def point_requests(args: argparse.Namespace, arrivals: Arrivals) -> int:
    """Requests a point sends: `--num`, or with `--seconds` a Poisson point's rate times that many seconds, so an
    overloaded point is a steady state rather than a burst its queue absorbs."""
    if args.seconds and arrivals.kind == "rate" and math.isfinite(arrivals.value):
        return max(1, round(arrivals.value * args.seconds))
    return args.num


def _one_per_event(text: str) -> int:
    return 1 if text else 0


def run_asyncio(coro: Any) -> None:
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(coro)


# ---- main ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Serving benchmark: Poisson and closed-loop load on a router + workers deployment.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--mode",
        default="disagg",
        help="comma-separated: agg (decode workers prefill locally), disagg (prefill + decode workers, fixed "
        "placement), adaptive (the same workers, adaptive placement), mixed (mixed workers, adaptive placement)",
    )
    p.add_argument("--url", help="benchmark a running router instead of starting deployments")
    p.add_argument("--model", default=os.environ.get("KVFERRY_MODEL", DEFAULT_MODEL))
    p.add_argument(
        "--gpus",
        type=lambda s: [g.strip() for g in s.split(",") if g.strip()],
        default=[],
        help="one worker process per GPU (CUDA_VISIBLE_DEVICES), KVFERRY_DEVICE=cuda",
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes without --gpus")
    p.add_argument(
        "--rates",
        help="Poisson arrival rates, req/s (inf: all at once); default 4,8,16 when --concurrency is not given either",
    )
    p.add_argument("--concurrency", help="closed-loop concurrency levels")
    p.add_argument("--num", type=int, default=100, help="requests per point")
    p.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        help="Poisson points send rate x this many requests instead of --num (a steady state at every rate)",
    )
    p.add_argument("--prompt-len", type=TokenRange.parse, default=TokenRange(512, 3072))
    p.add_argument("--output-len", type=TokenRange.parse, default=TokenRange(64, 512))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=25.0, help="per request: p99 of its inter-token gaps")
    p.add_argument(
        "--class-mix",
        type=parse_class_mix,
        default=(),
        help="SLO classes to send, with weights, e.g. interactive:0.5,batch:0.5 (the x-kvferry-class header); "
        "each point then reports goodput and attainment per class",
    )
    p.add_argument(
        "--slo-classes",
        default="",
        help="the classes' targets (KVFERRY_SLO_CLASSES syntax); given, the deployment started here gets them "
        "too; default: the deployment's default classes",
    )
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per mode (not measured)")
    p.add_argument("--offline", action="store_true", help="also run the offline engine on one device")
    p.add_argument("--worker-env", action="append", default=[], metavar="KEY=VALUE", help="extra worker env")
    p.add_argument("--router-env", action="append", default=[], metavar="KEY=VALUE", help="extra router env")
    p.add_argument(
        "--variant-env",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE",
        help="extra worker env of the modes written MODE@NAME",
    )
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for a deployment to come up")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        help="seconds a point waits after its last send (closed loop: in all) before timing out the rest",
    )
    p.add_argument("--request-timeout", type=float, default=120.0, help="longest silence on one stream")
    p.add_argument(
        "--retry-429",
        action="store_true",
        help="a request refused 429 waits its Retry-After and is sent again (saturation runs)",
    )
    p.add_argument("--offline-timeout", type=float, default=600.0)
    p.add_argument("--out", help="JSON path (default bench/out/serve_<model>_<time>.json)")
    p.add_argument("--log-dir", help="where the deployment's logs go (default: a temp dir, removed on success)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--plot-only", metavar="JSON", help="only draw the plots of an earlier run")
    return p


def parse_class_mix(text: str) -> tuple[tuple[str, float], ...]:
    """``name:weight,...`` -> ((name, weight), ...)."""
    out = []
    for part in (p for p in text.split(",") if p.strip()):
        name, _, weight = part.partition(":")
        w = float(weight or "1")
        if not name.strip() or w < 0:
            raise argparse.ArgumentTypeError(f"--class-mix {part!r}: expected name:weight")
        out.append((name.strip(), w))
    if not out or sum(w for _, w in out) <= 0:
        raise argparse.ArgumentTypeError("--class-mix needs a class with a positive weight")
    return tuple(out)


def _clean(obj: Any) -> Any:
    """NaN/inf -> None, so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def _for_router(env: dict[str, str]) -> dict[str, str]:
    # A variant is a policy, and a policy can be the router's (its admission) as well as the worker's; a setting
    # every component reads (the settings registry's "all") goes to both.
    shared = {name for name, s in REGISTRY.items() if s.who == "all"}
    return {k: v for k, v in env.items() if k.startswith("KVFERRY_ROUTER_") or k in shared}


def _for_worker(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith("KVFERRY_ROUTER_")}


def plot(path: Path) -> None:
    from serve_plot import plot_file

    for line in plot_file(path):
        say(line)


def print_summary(result: dict[str, Any]) -> None:
    offline = result.get("offline") or {}
    for mode, rec in result["modes"].items():
        pts = rec["points"]
        if not pts:
            continue
        best = max(p["output_tok_per_s"] for p in pts)
        line = f"{mode}: peak {best:.0f} output tok/s over {len(pts)} points"
        if offline.get("output_tok_per_s"):
            ceiling = offline["output_tok_per_s"] * rec["devices"]
            rec["served_over_offline"] = best / ceiling
            line += (
                f"; served/offline {best / ceiling:.2f} (offline {offline['output_tok_per_s']:.0f} x {rec['devices']})"
            )
        say(line)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot_only:
        plot(Path(args.plot_only))
        return 0
    if not args.rates and not args.concurrency:
        args.rates = "4,8,16"

    def _term(_signo: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    vocab, max_context = model_shape(args.model)
    if args.prompt_len.hi + args.output_len.hi > max_context:
        raise SystemExit(f"prompt + output up to {args.prompt_len.hi + args.output_len.hi} > context {max_context}")
    worker_env, router_env = parse_env(args.worker_env), parse_env(args.router_env)
    if args.slo_classes:  # the deployment started here declares the classes the bench measures against
        worker_env.setdefault("KVFERRY_SLO_CLASSES", args.slo_classes)
        router_env.setdefault("KVFERRY_SLO_CLASSES", args.slo_classes)
    variant_envs: dict[str, dict[str, str]] = {}
    for item in args.variant_env:
        name, sep, pair = item.partition(":")
        if not sep:
            raise SystemExit(f"--variant-env wants NAME:KEY=VALUE, not {item!r}")
        variant_envs.setdefault(name, {}).update(parse_env([pair]))
    if not args.gpus and "KVFERRY_TORCH_THREADS" not in {**os.environ, **worker_env}:
        # CPU workers on one machine: each gets its share of the cores, as a pod gets its CPU quota (an
        # engine sizes its threads to the cores it may use; here every worker could use them all).
        worker_env["KVFERRY_TORCH_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // args.workers))
    modes = ["url"] if args.url else [m.strip() for m in args.mode.split(",") if m.strip()]
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = (
        Path(args.out) if args.out else OUT_DIR / f"serve_{args.model.replace(':', '-').replace('/', '_')}_{stamp}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvferry-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    result: dict[str, Any] = {
        "config": {
            **{k: (str(v) if isinstance(v, TokenRange) else v) for k, v in vars(args).items()},
            "modes": modes,
            "vocab": vocab,
            "slo": {"ttft_ms": args.slo_ttft_ms, "itl_p99_ms": args.slo_itl_ms},
            "kvferry_env": {k: v for k, v in os.environ.items() if k.startswith("KVFERRY_")},
            "worker_env_applied": worker_env,
            "variant_env": variant_envs,
        },
        "git": git_commit(),
        "host": host_info(),
        "started": stamp,
        "offline": None,
        "modes": {},
    }

    def save() -> None:
        out.write_text(json.dumps(_clean(result), separators=(",", ":")))  # compact: run files travel to the GPU

    failed = False
    try:
        tok_dir = build_word_tokenizer(log_dir / "tokenizer", vocab, max_context)
        if args.offline:
            result["offline"] = run_offline(args, vocab, worker_env, log_dir)
            save()
        for mode in modes:
            base, _, variant = mode.partition("@")
            mode_log_dir = log_dir / variant if variant else log_dir
            mode_log_dir.mkdir(parents=True, exist_ok=True)
            spec = DeploySpec(
                mode=base,
                model=args.model,
                tokenizer_dir=str(tok_dir),
                gpus=tuple(args.gpus),
                cpu_workers=args.workers,
                worker_env={**worker_env, **_for_worker(variant_envs.get(variant, {}))},
                router_env={**router_env, **_for_router(variant_envs.get(variant, {}))},
                ready_timeout_s=args.ready_timeout,
                log_dir=mode_log_dir,
            )
            record: dict[str, Any] = {"points": [], "error": None}
            result["modes"][mode] = record
            deployment: Deployment | None = None
            try:
                if mode == "url":
                    url = args.url.rstrip("/")
                    record["devices"] = len(set(args.gpus)) or 1
                else:
                    roles = spec.roles()
                    record.update(devices=spec.devices, roles=roles)
                    say(f"{mode}: starting {', '.join(roles)} ({args.model}, logs in {log_dir})")
                    t0 = time.monotonic()
                    deployment = start_deployment(spec, say)
                    url = deployment.router_url
                    record["pids"] = [p.proc.pid for p in deployment.parts if p.proc is not None]
                    record["startup_s"] = time.monotonic() - t0
                    say(f"{mode}: ready in {record['startup_s']:.0f} s")
                run_asyncio(bench_mode(mode, url, args, vocab, slo, deployment, record, save))
                record["router_view"] = get_json(f"{url}/router/workers", 5.0)
            except DeployError as exc:
                failed = True
                record["error"] = str(exc)
                say(f"{mode} failed: {exc}")
            finally:
                if deployment is not None:
                    deployment.stop()
                save()
    except KeyboardInterrupt:
        failed = True
        say("interrupted: deployments stopped")
    result["client_imported_torch"] = "torch" in sys.modules
    print_summary(result)
    save()
    say(f"wrote {out}")
    if not args.no_plot:
        plot(out)
    settle_logs(log_dir, failed, bool(args.log_dir), say)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
