"""Decode step time at TP=2 (two GPUs, NCCL) against TP=1, llama-3.1-8b shape, dummy weights.

    python bench/tp_decode.py [--out bench/out/tp_decode.json] [--batches 1,8,64] [--ctx 1024]

Each step is what the decode loop runs: rank 0 broadcasts the step to the follower, both ranks run the
forward (CUDA graphs where the batch fits), logits are gathered and rank 0 reads the sampled tokens back.
Times are wall-clock per step with the host waiting for the tokens, as a serving loop does. The speedup is
TP=1 step time / TP=2 step time measured in the same run (ideal: 2.0 for the weight-bound small batches).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import give_rows, take_rows  # noqa: E402

from common.engine.runner import ModelRunner, RunnerConfig  # noqa: E402
from common.engine.sampling import argmax_rows  # noqa: E402


def step_times(runner: ModelRunner, batch: int, ctx: int, iters: int) -> dict:
    rows = take_rows(runner, [ctx] * batch)
    ids = torch.randint(0, runner.model_config.vocab_size, (batch,)).tolist()
    fb = runner.build_batch([[t] for t in ids], [ctx - 1] * batch, rows, [True] * batch, True)
    for _ in range(3):
        argmax_rows(runner.forward(fb)).cpu()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        argmax_rows(runner.forward(fb)).cpu()
        times.append((time.perf_counter() - t0) * 1e3)
    give_rows(runner, rows)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def measure(tp: int, batches: list[int], ctx: int, iters: int, graphs: bool = True, save=None) -> dict:
    """Step times per batch size; `save(partial)` runs after each one, before the runner is torn down."""
    start = time.perf_counter()
    runner = ModelRunner(
        RunnerConfig(
            model="dummy:llama-3.1-8b",
            device="cuda",
            kv_memory_gb=8.0,
            max_running=max(batches),
            max_seq_len=ctx + 64,
            cuda_graph_max_bs=max(batches) if graphs else 0,
            tp_size=tp,
        )
    )
    print(f"TP={tp} (graphs {'on' if graphs else 'off'}): ready in {time.perf_counter() - start:.1f} s", flush=True)
    for block in runner.pool.kv.split(4096):
        block.normal_()
    out = {}
    try:
        for b in batches:
            out[b] = step_times(runner, b, ctx, iters)
            print(
                f"TP={tp} b={b} ctx={ctx}: {out[b]['median_ms']:.3f} ms/step (min {out[b]['min_ms']:.3f})", flush=True
            )
    finally:
        runner.close()
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "tp_decode.json")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    batches = [int(b) for b in args.batches.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial: dict = {"model": "llama-3.1-8b (dummy)", "device": torch.cuda.get_device_name(), "ctx": args.ctx}

    def saver(key: str):
        def save(out: dict) -> None:
            partial[key] = out
            args.out.write_text(json.dumps(partial, indent=2) + "\n")

        return save

    tp1 = measure(1, batches, args.ctx, args.iters, save=saver("tp1_partial"))
    graphs = True
    try:
        tp2 = measure(2, batches, args.ctx, args.iters, save=saver("tp2_partial"))
    except Exception as e:  # report, then measure without graphs rather than nothing
        print(f"TP=2 with CUDA graphs failed: {type(e).__name__}: {e}", flush=True)
        graphs = False
        tp1 = measure(1, batches, args.ctx, args.iters, graphs=False)
        tp2 = measure(2, batches, args.ctx, args.iters, graphs=False)
    rows = []
    for b in batches:
        speedup = tp1[b]["median_ms"] / tp2[b]["median_ms"]
        rows.append({"batch": b, "ctx": args.ctx, "tp1": tp1[b], "tp2": tp2[b], "speedup": speedup})
        print(f"b={b}: TP=1 {tp1[b]['median_ms']:.3f} ms, TP=2 {tp2[b]['median_ms']:.3f} ms, speedup {speedup:.2f}x")
    result = {"model": "llama-3.1-8b (dummy)", "device": torch.cuda.get_device_name(), "graphs": graphs, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
