"""The offline engine's throughput on the serving benchmark's workload: the ceiling a served deployment is
compared with. Runs in its own process (bench/serve.py starts it with the environment a worker gets, one
GPU visible), so the benchmark's client never loads torch and the GPU is free again when it exits.

    python bench/serve_offline.py --model dummy:llama-3.1-8b --num 200 --prompt-len 512-3072 \
        --output-len 64-512 --seed 0 --out /tmp/offline.json

The engine is built from the same settings a decode worker reads (common/config.py WorkerConfig, so
KVFERRY_KV_MEMORY_GB, KVFERRY_MAX_RUNNING, KVFERRY_MAX_PREFILL_TOKENS, ... apply alike) with the same
thread choice; every request is submitted at once and run to completion (greedy, ``ignore_eos``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from serve_load import TokenRange, make_workload  # noqa: E402

WARMUP_REQUESTS = 4


def run_offline(model: str, num: int, prompt_len: TokenRange, output_len: TokenRange, seed: int, vocab: int) -> dict:
    from common.config import WorkerConfig
    from common.engine.threads import apply_engine_threads
    from common.offline import Engine
    from common.protocol import SamplingParams
    from common.settings_registry import MODEL, TORCH_THREADS

    os.environ[MODEL.name] = model
    cfg = WorkerConfig.from_env("decode")
    threads = apply_engine_threads(cfg.runner.device, TORCH_THREADS.read())
    t0 = time.perf_counter()
    engine = Engine(cfg.runner, cfg.sched, load_tokenizer=False)
    load_s = time.perf_counter() - t0
    items = make_workload(num, prompt_len, output_len, vocab, seed, model)
    prompts = [json.loads(it.payload)["prompt"] for it in items]
    outs = [it.max_tokens for it in items]

    # Warm-up on other prompts (no prefix hits on the measured ones): lazy kernels, graphs, allocator.
    warm = make_workload(WARMUP_REQUESTS, prompt_len, TokenRange(8, 8), vocab, seed + 10_000, model)
    engine.generate([json.loads(it.payload)["prompt"] for it in warm], SamplingParams(max_tokens=8, ignore_eos=True))

    params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs]
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    produced = sum(len(r.output_ids) for r in results)
    if produced != sum(outs):
        raise RuntimeError(f"offline run produced {produced} tokens, expected {sum(outs)}")
    n_in = sum(len(p) for p in prompts)
    return {
        "device": cfg.runner.device,
        "torch_threads": threads,
        "kv_memory_gb": cfg.runner.kv_memory_gb,
        "max_running": cfg.runner.max_running,
        "max_prefill_tokens": cfg.sched.max_prefill_tokens,
        "load_s": load_s,
        "requests": num,
        "input_tokens": n_in,
        "output_tokens": produced,
        "wall_s": wall,
        "output_tok_per_s": produced / wall,
        "total_tok_per_s": (produced + n_in) / wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num", type=int, required=True)
    p.add_argument("--prompt-len", type=TokenRange.parse, required=True)
    p.add_argument("--output-len", type=TokenRange.parse, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    res = run_offline(args.model, args.num, args.prompt_len, args.output_len, args.seed, args.vocab)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
