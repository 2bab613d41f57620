"""What computing a prompt's logprobs costs its prefill: one prompt prefilled (max_tokens 1) plain, then asking for
its logprobs with 0, 5 and 20 alternatives, on the offline engine (no prefix cache: every run computes the whole
prompt), with the ratio to plain measured in the same run; on CUDA also the peak memory each run allocated beyond
the engine's own (one chunk's float32 logits and their log-softmax).

    python bench/prompt_logprobs.py [--model PATH|dummy:NAME] [--device cuda] [--prompt-tokens 4096]
        [--chunk 2048] [--repeats 5] [--out bench/out/prompt_logprobs.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.offline import Engine  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402
from common.settings import RunnerConfig, SchedulerConfig  # noqa: E402


def timed(engine: Engine, ids: list[int], top: int | None, device: torch.device) -> tuple[float, int]:
    """Seconds to the first token, and the peak bytes allocated beyond what was allocated before (CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    t0 = time.perf_counter()
    [result] = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=top))
    elapsed = time.perf_counter() - t0
    if top is not None:
        assert result.prompt_logprobs is not None and len(result.prompt_logprobs.logprobs) == len(ids) - 1
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    return elapsed, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=RunnerConfig().model)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "bench/out/prompt_logprobs.json"))
    args = ap.parse_args()
    runner_cfg = RunnerConfig(model=args.model, device=args.device, max_running=8)
    engine = Engine(runner_cfg, SchedulerConfig(max_prefill_tokens=args.chunk, enable_prefix_cache=False))
    vocab = engine.runner.model_config.vocab_size
    ids = [(i * 7919 + 13) % (vocab - 1) + 1 for i in range(args.prompt_tokens)]  # any ids: timing only
    device = engine.runner.device
    cases: dict[str, int | None] = {"plain": None, "top0": 0, "top5": 5, "top20": 20}
    for top in cases.values():  # warm-up: kernels, allocator
        timed(engine, ids, top, device)
    runs: dict[str, list[float]] = {name: [] for name in cases}
    peaks: dict[str, int] = {name: 0 for name in cases}
    for _ in range(args.repeats):  # interleaved, so drift hits every case alike
        for name, top in cases.items():
            s, peak = timed(engine, ids, top, device)
            runs[name].append(s)
            peaks[name] = max(peaks[name], peak)
    best = {name: min(v) for name, v in runs.items()}
    out = {
        "model": args.model,
        "device": str(device),
        "prompt_tokens": args.prompt_tokens,
        "chunk": args.chunk,
        "vocab": vocab,
        "seconds_best": best,
        "ratio_to_plain": {name: best[name] / best["plain"] for name in cases},
        "peak_bytes_beyond_engine": peaks if device.type == "cuda" else None,
        "one_chunk_fp32_logits_bytes": args.chunk * vocab * 4,
    }
    print(json.dumps(out, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
