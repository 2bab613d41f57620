"""Decode throughput with a JSON-schema grammar on half the requests against none, same engine, same run.

    python bench/grammar_decode.py                    # CPU, 16 requests x 64 tokens, 5 rounds
    python bench/grammar_decode.py --device cuda --num-requests 128 --max-tokens 256

Workload: `--num-requests` chat prompts submitted at once, each generating exactly `--max-tokens` tokens
(min_tokens = max_tokens bans EOS; the schema's story field is too long to complete in the run). Run A: no
grammar. Run B: every other request under a JSON schema (an object with free-text and enum fields), the
rest as in A. Throughput = output tokens / wall time of the batch (prefill included: the same in both).
Rounds alternate A and B; the best of each counts. Target: B / A >= 0.9. Writes
`bench/out/grammar_<device>.json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT_DIR = Path(__file__).resolve().parent / "out"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "mood": {"type": "string", "enum": ["happy", "sad", "calm"]},
        "story": {"type": "string", "minLength": 4000},  # cannot complete within the run: equal lengths
    },
    "required": ["title", "mood", "story"],
    "additionalProperties": False,
}
TOPICS = ["the sea", "a robot", "a city at night", "a dragon", "the moon", "a library", "a storm", "a garden"]


def run(engine, prompts: list[list[int]], max_tokens: int, grammar_every: int) -> dict:
    from common.protocol import GrammarSpec, SamplingParams

    spec = GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA))
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            min_tokens=max_tokens,
            grammar=spec if grammar_every and i % grammar_every == 0 else None,
        )
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in results)
    errors = sum(r.finish_reason == "error" for r in results)
    return {
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "errors": errors,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch

    from common.default_model import convert_default_model
    from common.offline import Engine
    from common.settings import RunnerConfig

    path = convert_default_model()
    engine = Engine(RunnerConfig(model=str(path), device=args.device, max_running=max(args.num_requests, 8)))
    prompts = [
        engine.encode(f"Write a short story about {TOPICS[i % len(TOPICS)]} as JSON (title, mood, story).", True)
        for i in range(args.num_requests)
    ]
    run(engine, prompts[:2], 8, 2)  # warm-up: weights, grammar compiler, tokenizer tables
    plain, mixed = [], []
    for _ in range(args.rounds):
        plain.append(run(engine, prompts, args.max_tokens, 0))
        mixed.append(run(engine, prompts, args.max_tokens, 2))
    best_plain = max(plain, key=lambda r: r["tokens_per_s"])
    best_mixed = max(mixed, key=lambda r: r["tokens_per_s"])
    ratio = best_mixed["tokens_per_s"] / best_plain["tokens_per_s"]
    out = {
        "device": args.device,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "no_grammar": plain,
        "half_grammar": mixed,
        "ratio_half_grammar_to_none": round(ratio, 3),
        "target": 0.9,
    }
    OUT_DIR.mkdir(exist_ok=True)
    path_out = OUT_DIR / f"grammar_{args.device}.json"
    path_out.write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"no grammar: {best_plain['tokens_per_s']} tok/s   half under a JSON schema: {best_mixed['tokens_per_s']} tok/s"
        f"   ratio {ratio:.3f} (target >= 0.9)   -> {path_out}"
    )


if __name__ == "__main__":
    main()
