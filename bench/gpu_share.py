"""Two processes time-sharing one GPU: a decode step's and a prompt chunk's time alone and while the other process
steps beside it: the shares of the device each keeps, from which bench/fleet_sim/calibrate.py derives the
simulator's sharing weights (bench/fleet_sim/device.py; fair sharing would give each of two busy loops half).

    python bench/gpu_share.py --out bench/out/gpu_share_h200.json          # dummy Llama-3.1-8B on one GPU
    python bench/gpu_share.py --overlap --out bench/out/gpu_share_overlap_h200.json   # loops as the engine's
    python bench/gpu_share.py --overlap --chunk 512 --out bench/out/gpu_share_overlap_chunk512_h200.json
    python bench/gpu_share.py --overlap --prefill-gap-ms 100 --out bench/out/gpu_share_gap100_h200.json  # lone prompts
    python bench/gpu_share.py --kernels ...   # also each step's kernels alone: how many, how long (profiler)
    python bench/gpu_share.py --device cpu --model smollm2-135m-instruct --batch 2 --context 64 --chunk 64 \
        --iters 5 --seconds 2 --kv-gb 0.05 --out /tmp/gpu_share_cpu.json   # the plumbing, on the CPU

Each process builds its own engine (ModelRunner) on the device. One steps a decode batch of `--batch` rows at
`--context` tokens of KV each, the other a prompt chunk of `--chunk` tokens (the prefill worker's step). Phases:
the decode loop alone, the chunk loop alone (`--iters` steps each, the other process waiting), then both back to
back for `--seconds`. A step's time is wall clock around forward + sampling + synchronize, so it holds the time
the device gave the other process. With `--overlap` each loop launches its next step before waiting on the one in
flight, as the serving engine's scheduler does on a GPU (overlap on): its process then always has work queued on
the device, where the plain loop leaves it empty while it waits; a step's time is then the gap between the ends of
two steps as the host sees them. Reported per loop: p50 / p99 alone and shared, the slowdown (shared mean /
alone mean) and the share of the device it kept (alone mean / shared mean); `device_kept` sums the two shares
(1.0: work-conserving sharing as the simulator models it; below: time lost to switching; above: overlap or host
gaps the other filled). These are microbenchmark figures for the simulator's sharing model, not a serving run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.roofline import give_rows, log, take_rows  # noqa: E402
from common.engine.runner import ModelRunner, RunnerConfig  # noqa: E402
from common.engine.sampling import argmax_rows  # noqa: E402

ROLES = ("decode", "prefill")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Finished:
    """A step launched on the CPU: done when its launch returns."""

    def synchronize(self) -> None:
        return None


def _step_fn(runner: ModelRunner, role: str, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """One step of `role` on fresh rows (random KV: never time on zeros); returns (launch, its rows): `launch`
    queues the step and returns what to wait on for its end."""
    vocab = runner.model_config.vocab_size
    for block in runner.pool.kv.split(4096):
        block.normal_()
    if role == "decode":
        rows = take_rows(runner, [args.context] * args.batch)
        ids = torch.randint(0, vocab, (args.batch,)).tolist()
        fb = runner.build_batch([[t] for t in ids], [args.context - 1] * args.batch, rows, [True] * args.batch, True)
    else:
        rows = take_rows(runner, [args.chunk])
        fb = runner.build_batch([torch.randint(0, vocab, (args.chunk,)).tolist()], [0], rows, [True], False)

    def launch():  # type: ignore[no-untyped-def]
        argmax_rows(runner.forward(fb))
        if not args.device.startswith("cuda"):
            return _Finished()
        end = torch.cuda.Event()
        end.record()
        return end

    return launch, rows


def _steps(launch, overlap: bool, count: int = 0, until: float = 0.0, gap_s: float = 0.0) -> list[float]:  # type: ignore[no-untyped-def]
    """Step times (ms) of `count` steps, or of the steps until `until` (perf_counter): each waited on before the
    next is launched, or with `overlap` the next launched first; with `gap_s` each waited on, then the loop idles
    that long before the next (prompts arriving one at a time: nothing queued between them)."""
    times: list[float] = []

    def more() -> bool:
        return len(times) < count if count else time.perf_counter() < until

    if not overlap or gap_s > 0:
        while more():
            t0 = time.perf_counter()
            launch().synchronize()
            times.append((time.perf_counter() - t0) * 1000)
            if gap_s > 0:
                time.sleep(gap_s)
        return times
    pending, last = launch(), time.perf_counter()
    while more():
        queued = launch()
        pending.synchronize()
        now = time.perf_counter()
        times.append((now - last) * 1000)
        pending, last = queued, now
    pending.synchronize()
    return times


def _kernels(launch) -> dict:  # type: ignore[no-untyped-def]
    """The kernels of one step alone, as the profiler sees them (copies and memsets left out): how many and how
    long. Kernel-by-kernel alternation gives each process the length of its kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launch().synchronize()
    us = [
        e.time_range.elapsed_us()
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    ]
    return {"count": len(us), "mean_us": statistics.fmean(us) if us else 0.0, "total_us": float(sum(us))}


@torch.inference_mode()
def _child(role: str, args: argparse.Namespace, barrier, results) -> None:  # type: ignore[no-untyped-def]
    if args.device == "cpu":
        torch.set_num_threads(1)
    runner = ModelRunner(
        RunnerConfig(
            model=args.model,
            device=args.device,
            kv_memory_gb=args.kv_gb,
            max_running=max(8, args.batch),
            max_seq_len=max(args.context, args.chunk) + 16,
            cuda_graph_max_bs=max(8, args.batch),
        )
    )
    launch, rows = _step_fn(runner, role, args)
    _steps(launch, False, count=3)  # warm-up: lazy inits, graph planning
    _sync(args.device)
    kernels = _kernels(launch) if args.kernels else None
    alone: list[float] = []
    barrier.wait()  # both engines ready
    for turn in ROLES:  # each loop alone while the other waits
        if turn == role:
            alone = _steps(launch, args.overlap, count=args.iters)
        barrier.wait()
    gap_s = args.prefill_gap_ms / 1000 if role == "prefill" else 0.0
    shared = _steps(launch, args.overlap, until=time.perf_counter() + args.seconds, gap_s=gap_s)
    give_rows(runner, rows)
    results.put((role, alone, shared, kernels))


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))] if s else float("nan")


def summarize(got: dict[str, tuple[list[float], list[float], dict | None]]) -> dict:
    out: dict = {}
    kept = 0.0
    for role in ROLES:
        alone, shared, kernels = got[role]
        a, s = statistics.fmean(alone), statistics.fmean(shared)
        out[role] = {
            "alone_ms": {"p50": _pct(alone, 50), "p99": _pct(alone, 99), "mean": a, "n": len(alone)},
            "shared_ms": {
                "p50": _pct(shared, 50),
                "p90": _pct(shared, 90),
                "p99": _pct(shared, 99),
                "max": max(shared),
                "mean": s,
                "n": len(shared),
            },
            "slowdown": s / a,
            "device_share": a / s,
            # every step beside the other loop, in order: how the stretch is spread over steps (a few long waits
            # or many short ones) is what the simulator's slice rule must reproduce
            "shared_steps_ms": [round(x, 3) for x in shared],
        }
        if kernels is not None:
            out[role]["kernels"] = kernels
        kept += a / s
    out["device_kept"] = kept
    out["fair_share_slowdown"] = 2.0
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=32, help="decode rows")
    p.add_argument("--context", type=int, default=2048, help="KV tokens per decode row")
    p.add_argument("--chunk", type=int, default=2048, help="prompt tokens per prefill step")
    p.add_argument("--iters", type=int, default=50, help="steps of each loop alone")
    p.add_argument("--seconds", type=float, default=10.0, help="both loops together")
    p.add_argument("--kv-gb", type=float, default=20.0, help="each process's KV pool")
    p.add_argument("--overlap", action="store_true", help="launch each next step before waiting (the serving loop)")
    p.add_argument(
        "--prefill-gap-ms",
        type=float,
        default=0.0,
        help="the chunk loop idles this long after each chunk (a lone prompt at a time; its share is then not a busy loop's)",
    )
    p.add_argument("--kernels", action="store_true", help="profile one step of each alone: its kernels (GPU)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "gpu_share.json")
    args = p.parse_args()
    if args.kernels and not args.device.startswith("cuda"):
        p.error("--kernels profiles GPU kernels: it needs --device cuda")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(role, args, barrier, results)) for role in ROLES]
    for proc in procs:
        proc.start()
    got = {}
    for _ in ROLES:
        role, alone, shared, kernels = results.get(timeout=1800)
        got[role] = (alone, shared, kernels)
    for proc in procs:
        proc.join()
    result = {"args": {k: str(v) for k, v in vars(args).items()}, **summarize(got)}
    if args.device.startswith("cuda"):
        result["device_name"] = torch.cuda.get_device_name()
    for role in ROLES:
        r = result[role]
        log(
            f"{role}: alone p50 {r['alone_ms']['p50']:.2f} ms, shared p50 {r['shared_ms']['p50']:.2f} / p99 "
            f"{r['shared_ms']['p99']:.2f} ms, slowdown {r['slowdown']:.2f}x (fair share: 2x), device share "
            f"{r['device_share']:.2f}"
        )
        if "kernels" in r:
            k = r["kernels"]
            log(f"{role}: {k['count']} kernels a step alone, {k['mean_us']:.1f} us each, {k['total_us'] / 1000:.2f} ms")
    log(f"device kept by the two together: {result['device_kept']:.2f} (work-conserving sharing: 1.0)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
