"""Offline CPU throughput: kvferry's engine against transformers `generate`, same weights, same run.

    python bench/engine_cpu.py                       # 32 requests, seed 0
    python bench/engine_cpu.py --num-requests 16 --seed 1
    python bench/engine_cpu.py --profile             # also cProfile our engine on the workload
    python bench/engine_cpu.py --ablate-linear       # also our engine with plain F.linear GEMMs

Workload (seeded): `--num-requests` concurrent requests, prompt lengths uniform in [16, 256] tokens cut from
real text (the source of a few standard-library modules, tokenized), output lengths uniform in [16, 128],
greedy with ignore_eos. The model is the packaged default (SmolLM2-135M-Instruct, float32).

- kvferry: `ModelRunner(RunnerConfig())` and its scheduler stepped to completion (what `Engine.generate` does),
  every request submitted at once (continuous
  batching, chunked prefill, paged KV).
- transformers: one `generate` call over the whole batch, left-padded, do_sample=False, max_new_tokens = the
  batch's largest output length. Only each request's requested tokens count as useful output.

Throughput = useful output tokens / wall time of the whole batch (prefill included). Writes
`bench/out/engine_cpu.json`.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import inspect
import json
import os
import platform
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm import tqdm

OUT_DIR = Path(__file__).resolve().parent / "out"
TEXT_MODULES = ("argparse", "inspect", "textwrap", "json.decoder", "email.message", "logging")


def load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def make_workload(tokenizer: Any, num_requests: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in TEXT_MODULES)
    stream = tokenizer.encode(text)
    prompts, outputs = [], []
    for _ in range(num_requests):
        n = rng.randint(16, 256)
        start = rng.randrange(0, len(stream) - n)
        prompts.append(stream[start : start + n])
        outputs.append(rng.randint(16, 128))
    return prompts, outputs


def run_kvferry(engine: Any, prompts: list[list[int]], outputs: list[int], show: bool) -> dict[str, Any]:
    from common.protocol import SamplingParams
    from common.sched.request import Req

    sched = engine.scheduler
    reqs = [
        Req(req_id=f"bench-{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, outputs))
    ]
    bar = tqdm(total=sum(outputs), desc="kvferry", unit="tok", disable=not show, leave=False, mininterval=2.0)
    steps = 0
    start = time.perf_counter()
    first_token: dict[str, float] = {}
    for r in reqs:
        sched.add(r)
    while sched.has_work():
        events = sched.step()
        steps += 1
        now = time.perf_counter()
        for e in events:
            first_token.setdefault(e.req.req_id, now - start)
            bar.update(len(e.tokens))
    elapsed = time.perf_counter() - start
    bar.close()
    assert all(r.finish_reason == "length" and len(r.output_ids) == n for r, n in zip(reqs, outputs))
    ttft = sorted(first_token.values())
    return {
        "seconds": elapsed,
        "steps": steps,
        "ttft_median_s": ttft[len(ttft) // 2],
        "outputs": [r.output_ids for r in reqs],
    }


class _Progress:
    """A stopping criterion that never stops, only advances a progress bar once per generated position."""

    def __init__(self, bar: tqdm, per_step: int) -> None:
        self.bar = bar
        self.per_step = per_step

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.bar.update(self.per_step)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def run_transformers(hf: Any, prompts: list[list[int]], outputs: list[int], pad_id: int, show: bool) -> dict[str, Any]:
    from transformers import StoppingCriteria, StoppingCriteriaList

    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    max_new = max(outputs)
    bar = tqdm(
        total=max_new * len(prompts), desc="transformers", unit="tok", disable=not show, leave=False, mininterval=2.0
    )
    progress = type("Progress", (_Progress, StoppingCriteria), {})(bar, len(prompts))
    start = time.perf_counter()
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=None,
        stopping_criteria=StoppingCriteriaList([progress]),
    )
    elapsed = time.perf_counter() - start
    bar.close()
    gen = out[:, longest:]
    return {"seconds": elapsed, "outputs": [gen[i, :n].tolist() for i, n in enumerate(outputs)]}


def profile_kvferry(engine: Any, prompts: list[list[int]], outputs: list[int], top: int) -> dict[str, Any]:
    prof = cProfile.Profile()
    prof.enable()
    res = run_kvferry(engine, prompts, outputs, show=False)
    prof.disable()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / "engine_cpu.prof"
    prof.dump_stats(path)
    stats = pstats.Stats(prof).strip_dirs().sort_stats("tottime")
    print(f"\n== cProfile of kvferry on this workload ({res['seconds']:.1f} s under the profiler); top by tottime ==")
    stats.print_stats(top)
    return {"seconds": res["seconds"], "pstats": str(path)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--ablate-linear",
        action="store_true",
        help="also time kvferry with plain F.linear (RunnerConfig.cpu_linear='torch', the GEMMs transformers runs)",
    )
    p.add_argument("--profile", action="store_true", help="also run our engine under cProfile and print hot spots")
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--out", type=Path, default=OUT_DIR / "engine_cpu.json")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    show = not args.no_progress
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.engine.runner import ModelRunner, RunnerConfig
    from common.offline import Engine
    from common.settings import SchedulerConfig

    print(f"load average before: {load_avg()}  (cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()})")
    print("(other processes on the machine compete for the same cores: compare runs by their load averages)")
    t0 = time.perf_counter()
    runner = ModelRunner(RunnerConfig())
    assert runner.model_path is not None
    tokenizer = AutoTokenizer.from_pretrained(runner.model_path)
    hf = AutoModelForCausalLM.from_pretrained(runner.model_path, dtype=torch.float32).eval()
    print(f"models loaded in {time.perf_counter() - t0:.1f} s")

    prompts, outputs = make_workload(tokenizer, args.num_requests, args.seed)
    useful = sum(outputs)
    print(
        f"workload: {len(prompts)} requests, prompt tokens {sum(len(x) for x in prompts)} "
        f"(min {min(len(x) for x in prompts)}, max {max(len(x) for x in prompts)}), "
        f"output tokens {useful} (min {min(outputs)}, max {max(outputs)})"
    )

    def new_engine() -> Engine:  # a fresh scheduler (empty prefix cache) over the loaded runner
        return Engine(runner=runner, sched_cfg=SchedulerConfig(max_prefill_tokens=args.max_prefill_tokens))

    # Warm-up (one-time allocator / kernel initialisation), not timed.
    run_kvferry(new_engine(), prompts[:2], [4, 4], show=False)
    if not args.skip_transformers:
        run_transformers(hf, prompts[:2], [4, 4], tokenizer.eos_token_id or 0, show=False)

    load_ours = load_avg()
    ours = run_kvferry(new_engine(), prompts, outputs, show)
    ours_tps = useful / ours["seconds"]
    print(
        f"kvferry:      {ours['seconds']:7.2f} s  {ours_tps:8.1f} output tok/s  "
        f"({ours['steps']} steps, median TTFT {ours['ttft_median_s']:.2f} s)  load {load_ours}"
    )
    result: dict[str, Any] = {
        "workload": {
            "num_requests": len(prompts),
            "seed": args.seed,
            "prompt_tokens": sum(len(x) for x in prompts),
            "output_tokens": useful,
            "prompt_lens": [len(x) for x in prompts],
            "output_lens": outputs,
            "max_prefill_tokens": args.max_prefill_tokens,
        },
        "kvferry": {
            "seconds": round(ours["seconds"], 3),
            "output_tokens_per_s": round(ours_tps, 2),
            "steps": ours["steps"],
            "ttft_median_s": round(ours["ttft_median_s"], 3),
            "load_avg_at_start": load_ours,
        },
        "env": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
    }
    if not args.skip_transformers:
        load_hf = load_avg()
        ref = run_transformers(hf, prompts, outputs, tokenizer.eos_token_id or 0, show)
        hf_tps = useful / ref["seconds"]
        padded = len(prompts) * max(outputs)
        print(
            f"transformers: {ref['seconds']:7.2f} s  {hf_tps:8.1f} output tok/s  "
            f"({padded} tokens generated, {useful} useful)  load {load_hf}"
        )
        same = sum(a == b for a, b in zip(ours["outputs"], ref["outputs"]))
        ratio = ours_tps / hf_tps
        print(f"ratio kvferry / transformers: {ratio:.2f}x   (identical greedy outputs: {same}/{len(prompts)})")
        result["transformers"] = {
            "seconds": round(ref["seconds"], 3),
            "output_tokens_per_s": round(hf_tps, 2),
            "generated_tokens_incl_padding": padded,
            "load_avg_at_start": load_hf,
        }
        result["ratio"] = round(ratio, 3)
        result["identical_outputs"] = f"{same}/{len(prompts)}"
    if args.ablate_linear:
        runner.model.unpack_linears()
        load_abl = load_avg()
        abl = run_kvferry(new_engine(), prompts, outputs, show)
        runner.model.pack_linears()
        abl_tps = useful / abl["seconds"]
        print(f"kvferry with F.linear (no oneDNN packing): {abl['seconds']:7.2f} s  {abl_tps:8.1f} output tok/s")
        result["kvferry_f_linear"] = {
            "seconds": round(abl["seconds"], 3),
            "output_tokens_per_s": round(abl_tps, 2),
            "load_avg_at_start": load_abl,
        }
    if args.profile:
        result["profile"] = profile_kvferry(new_engine(), prompts, outputs, args.profile_top)
    result["env"]["load_avg_at_end"] = load_avg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
