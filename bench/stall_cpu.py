"""A long prompt beside a decoding stream on one CPU engine: how long the stream stalls, prefill-first vs mixed.

    python bench/stall_cpu.py                        # 4.9k-token prompt, the packaged model, both policies
    python bench/stall_cpu.py --prompt-tokens 2000 --targets 0,auto,50

One engine (the packaged SmolLM2-135M, float32, `KVFERRY_TORCH_THREADS` or all cores), one fresh scheduler per
ITL target (`0` = prefill-first, the old policy; `auto` = the default; N = ms). A greedy stream decodes; once
it has produced `--lead` tokens a long prompt (real text: standard-library sources, tokenized) is added. Per
policy: the stream's worst gap between two tokens while the prompt prefills, the prompt's prefill time (added
to first token), their ratio (the issue's target: <= 0.25), how many steps the prompt took, and whether the
stream's and the prompt's tokens equal the prefill-first run's. Wall clock, one process: the ratio is
in-run. Writes bench/out/stall_cpu.json.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common.settings_registry import itl_target_ms

OUT_DIR = Path(__file__).resolve().parent / "out"
TEXT_MODULES = ("argparse", "inspect", "textwrap", "json.decoder", "email.message", "logging", "typing")


def run_policy(runner: Any, target_ms: float, stream_prompt: list[int], long_prompt: list[int], args) -> dict:
    from common.protocol import SamplingParams
    from common.sched.request import Req
    from common.sched.scheduler import Scheduler
    from common.settings import SchedulerConfig

    cfg = SchedulerConfig(max_prefill_tokens=args.max_prefill_tokens, itl_target_ms=target_ms, host_kv_gb=0)
    sched = Scheduler(runner, cfg)
    stream = Req("stream", list(stream_prompt), SamplingParams(max_tokens=args.stream_tokens, ignore_eos=True))
    long = Req("long", list(long_prompt), SamplingParams(max_tokens=args.long_tokens, ignore_eos=True))
    sched.add(stream)
    stamps: list[float] = []  # wall time of each stream token
    added_at = first_at = None
    steps_prefilling = 0
    kinds: dict[str, int] = {}
    while sched.has_work():
        if added_at is None and len(stream.output_ids) >= args.lead:
            sched.add(long)
            added_at = time.perf_counter()
        events = sched.step()
        now = time.perf_counter()
        kinds[sched.processed_kind or "none"] = kinds.get(sched.processed_kind or "none", 0) + 1
        if added_at is not None and first_at is None:
            steps_prefilling += 1
        for e in events:
            if e.req is stream:
                stamps += [now] * len(e.tokens)
            elif e.req is long and first_at is None and e.tokens:
                first_at = now
    assert added_at is not None and first_at is not None, "the stream ended before the long prompt was added"
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > added_at and a < first_at]
    # The stream's gaps before the prompt arrived: its own decode step.
    before = [b - a for a, b in zip(stamps, stamps[1:]) if b <= added_at]
    prefill_s = first_at - added_at
    worst = max(gaps) if gaps else 0.0
    return {
        "itl_target_ms": target_ms,
        "prefill_s": round(prefill_s, 3),
        "worst_gap_s": round(worst, 4),
        "gap_over_prefill": round(worst / prefill_s, 4),
        "decode_step_s_before": round(sorted(before)[len(before) // 2], 4) if before else None,
        "steps_while_prefilling": steps_prefilling,
        "stream_tokens_while_prefilling": len(gaps),
        "step_kinds": kinds,
        "budget_beside_decoding": sched.prefill_token_budget(decoding=True),
        "itl_target_s": round(sched.pacing.itl_target_s(), 4),
        "stream_ids": stream.output_ids,
        "long_ids": long.output_ids,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=4900)
    p.add_argument("--stream-prompt-tokens", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=0, help="stream length (0: enough to outlast the prefill)")
    p.add_argument("--long-tokens", type=int, default=8)
    p.add_argument("--lead", type=int, default=8, help="stream tokens before the long prompt arrives")
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--targets", default="0,auto", help="ITL targets: 0 (prefill-first), auto, or ms")
    p.add_argument("--out", default=str(OUT_DIR / "stall_cpu.json"))
    args = p.parse_args()

    from transformers import AutoTokenizer

    from common.default_model import resolve_model_path
    from common.engine.runner import ModelRunner
    from common.settings import RunnerConfig

    threads = int(os.environ.get("KVFERRY_TORCH_THREADS", "0") or 0)
    if threads:
        torch.set_num_threads(threads)
    path = resolve_model_path("smollm2-135m-instruct")
    runner = ModelRunner(RunnerConfig(model=str(path), num_pages=1024, max_running=4))
    if args.prompt_tokens + args.long_tokens > runner.max_seq_len:
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens} exceeds the context ({runner.max_seq_len})")
    tok = AutoTokenizer.from_pretrained(path)
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in TEXT_MODULES)
    ids = tok.encode(text)
    if len(ids) < args.prompt_tokens + args.stream_prompt_tokens:
        raise SystemExit(f"only {len(ids)} tokens of text")
    stream_prompt = ids[: args.stream_prompt_tokens]
    long_prompt = ids[args.stream_prompt_tokens : args.stream_prompt_tokens + args.prompt_tokens]
    if not args.stream_tokens:
        # One token per step of 4 pages while mixed, plus a margin: the stream outlasts the prefill either way.
        args.stream_tokens = args.lead + args.prompt_tokens // 64 + 40

    results = []
    for t in args.targets.split(","):
        r = run_policy(runner, itl_target_ms(t.strip()), stream_prompt, long_prompt, args)
        results.append(r)
        print(
            f"ITL target {t:>5}: prefill {r['prefill_s']:.2f} s in {r['steps_while_prefilling']} steps, stream's worst "
            f"gap {r['worst_gap_s']:.3f} s = {r['gap_over_prefill']:.3f} of the prefill "
            f"({r['stream_tokens_while_prefilling']} tokens meanwhile; decode step {r['decode_step_s_before']} s)",
            flush=True,
        )
    base = results[0]
    for r in results:
        r["stream_text_equal"] = r["stream_ids"] == base["stream_ids"]
        r["long_text_equal"] = r["long_ids"] == base["long_ids"]
        r["gap_over_first_policy_prefill"] = round(r["worst_gap_s"] / base["prefill_s"], 4)
    for r in results[1:]:
        print(
            f"target {r['itl_target_ms']}: gap / prefill {r['gap_over_prefill']:.3f} "
            f"(/ the first policy's prefill {r['gap_over_first_policy_prefill']:.3f}), text equal: "
            f"stream {r['stream_text_equal']}, long {r['long_text_equal']}, TTFT x{r['prefill_s'] / base['prefill_s']:.2f}"
        )
    out = {
        "args": vars(args),
        "host": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "machine": platform.machine()},
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "results": [{k: v for k, v in r.items() if not k.endswith("_ids")} for r in results],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    ok = all(r["stream_text_equal"] and r["long_text_equal"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
