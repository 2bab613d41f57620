"""Host microseconds per decode step: the scheduler's own work, at several batch sizes and two pool sizes.

    python bench/host_step.py                                   # CPU, the host-probe model, small vs 100 GB pool
    python bench/host_step.py --device cuda --model dummy:llama-3.1-8b --large-gb 100 --small-gb 4

What counts as host work: the wall time of `Scheduler.step()` minus the time spent waiting for the device
(the launched step's done event) and, on the CPU, minus the model's forward itself (there the forward is
computed by the same thread). What is left is scheduling, allocation, page-table writes, batch inputs,
attention metadata, kernel launches and reading the sampled tokens. Each batch runs with every request at
~`--context` tokens and crosses page boundaries (new pages are allocated during the measured steps).

On the CPU the large pool has as many pages as 100 GB of llama-3.1-8b KV (2 MiB pages of 16 tokens: 47,683),
so the ratio large/small shows whether host work grows with the pool (it should stay ~1.0). Writes
bench/out/host_step_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common.engine.runner import ModelRunner
from common.engine.threads import apply_engine_threads
from common.protocol import SamplingParams
from common.sched import launched as launched_mod
from common.sched.request import Req
from common.sched.scheduler import Scheduler
from common.settings import RunnerConfig, SchedulerConfig
from common.settings_registry import TORCH_THREADS

OUT_DIR = Path(__file__).resolve().parent / "out"
PAGES_100GB_8B = 47_683  # 100 GiB / (32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes x 16 tokens)


class StepClock:
    """Splits a step's wall time into device waits, CPU forwards and the rest (host work)."""

    def __init__(self, runner: ModelRunner, cpu_forward: bool) -> None:
        self.waited = 0.0
        self.forward = 0.0
        orig_wait = launched_mod.Launched.wait
        clock = self

        def timed_wait(launched: launched_mod.Launched) -> None:
            t = time.perf_counter()
            orig_wait(launched)
            clock.waited += time.perf_counter() - t

        launched_mod.Launched.wait = timed_wait  # type: ignore[method-assign]
        if cpu_forward:
            orig_forward = runner.forward

            def timed_forward(batch):  # type: ignore[no-untyped-def]
                t = time.perf_counter()
                out = orig_forward(batch)
                clock.forward += time.perf_counter() - t
                return out

            runner.forward = timed_forward  # type: ignore[method-assign]

    def reset(self) -> None:
        self.waited = self.forward = 0.0


def measure(args: argparse.Namespace, runner: ModelRunner, batch: int, steps: int) -> dict[str, float]:
    # No host KV tier: what is measured is the step's own host work (a tier's copies happen only on eviction).
    sched = Scheduler(runner, SchedulerConfig(max_prefill_tokens=args.max_prefill, host_kv_gb=0))
    vocab = runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, vocab - 1, (args.context,), generator=gen).tolist()
        sp = SamplingParams(max_tokens=steps + args.warmup + 4, ignore_eos=True)
        sched.add(Req(req_id=f"b{batch}-{i}", prompt_ids=prompt, sampling=sp))
    while sched.waiting or sched.chunked is not None:  # prefill everything first
        sched.step()
    clock = StepClock(runner, cpu_forward=runner.device.type == "cpu")
    for _ in range(args.warmup):
        sched.step()
    host = []
    for _ in range(steps):
        clock.reset()
        t = time.perf_counter()
        sched.step()
        wall = time.perf_counter() - t
        host.append((wall - clock.waited - clock.forward) * 1e6)
    while sched.has_work():
        sched.step()
    return {
        "batch": batch,
        "host_us_p50": round(statistics.median(host), 1),
        "host_us_mean": round(statistics.fmean(host), 1),
        "host_us_p90": round(sorted(host)[int(0.9 * (len(host) - 1))], 1),
        "pages": sched.allocator.num_pages,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="dummy:host-probe")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=64, help="measured decode steps per point (crosses 4 pages)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--max-prefill", type=int, default=8192)
    ap.add_argument("--small-pages", type=int, default=20_000)
    ap.add_argument("--large-pages", type=int, default=PAGES_100GB_8B)
    ap.add_argument("--small-gb", type=float, default=0.0, help="size pools in GB instead of pages (GPU)")
    ap.add_argument("--large-gb", type=float, default=0.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    threads = apply_engine_threads(args.device, TORCH_THREADS.read())
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    for label, pages, gb in (("small", args.small_pages, args.small_gb), ("large", args.large_pages, args.large_gb)):
        cfg = RunnerConfig(
            model=args.model,
            device=args.device,
            num_pages=0 if gb else pages,
            kv_memory_gb=gb or 1.0,
            max_running=max(batches),
            max_seq_len=args.context + args.steps + args.warmup + 64,
        )
        runner = ModelRunner(cfg)
        for b in batches:
            r = measure(args, runner, b, args.steps)
            r["pool"] = label
            results.append(r)
            print(
                f"pool={label:5s} pages={r['pages']:6d} batch={b:4d} host us/step p50={r['host_us_p50']:8.1f} "
                f"mean={r['host_us_mean']:8.1f}",
                flush=True,
            )
        runner.close()
        del runner
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    ratios = {}
    for b in batches:
        small = next(r for r in results if r["pool"] == "small" and r["batch"] == b)
        large = next(r for r in results if r["pool"] == "large" and r["batch"] == b)
        ratios[b] = round(large["host_us_p50"] / small["host_us_p50"], 3)
        print(f"batch={b:4d} host us/step large/small pool = {ratios[b]:.3f}")
    out = Path(args.out) if args.out else OUT_DIR / f"host_step_{args.device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "device": args.device,
        "model": args.model,
        "context": args.context,
        "torch_threads": threads,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "results": results,
        "large_over_small": ratios,
    }
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
