"""cProfile of the scheduler's decode steps (host side): where a step's host time goes.

python bench/host_profile.py --device cuda --model dummy:llama-3.1-8b --batch 256 --kv-gb 60
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common.engine.runner import ModelRunner
from common.engine.threads import apply_engine_threads
from common.protocol import SamplingParams
from common.sched.request import Req
from common.sched.scheduler import Scheduler
from common.settings import RunnerConfig, SchedulerConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="dummy:host-probe")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kv-gb", type=float, default=4.0)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    apply_engine_threads(args.device)
    runner = ModelRunner(
        RunnerConfig(
            model=args.model,
            device=args.device,
            kv_memory_gb=args.kv_gb,
            max_running=args.batch,
            max_seq_len=args.context + args.steps + 64,
        )
    )
    sched = Scheduler(runner, SchedulerConfig(max_prefill_tokens=8192))
    vocab = runner.model_config.vocab_size
    for i in range(args.batch):
        prompt = torch.randint(0, vocab - 1, (args.context,)).tolist()
        sched.add(
            Req(req_id=str(i), prompt_ids=prompt, sampling=SamplingParams(max_tokens=args.steps + 20, ignore_eos=True))
        )
    while sched.waiting or sched.chunked is not None:
        sched.step()
    for _ in range(10):
        sched.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        sched.step()
    prof.disable()
    stats = pstats.Stats(prof)
    print(f"batch {args.batch}: {stats.total_tt / args.steps * 1e3:.3f} ms per step under the profiler")
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumtime").print_stats(args.top)


if __name__ == "__main__":
    main()
