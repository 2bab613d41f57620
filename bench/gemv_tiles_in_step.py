"""GEMV tile shapes inside the whole decode step at batch 1 (run on the GPU machine).

    python bench/gemv_tiles_in_step.py --out OUT.json [--model llama-3.1-8b] [--weight-dtype fp8_e4m3]
        [--tiles "qkv8x1024=6144,4096:8,1024,4,3;lm16x256=128256,4096:16,256,4,3"] [--repeats 2]

bench/decode_kernels.py times each GEMV alone; inside a step the GEMVs run back to back as dependent launches
between the norms, attention and RoPE kernels, and a tile that wins alone can lose there. This builds one engine
(random weights, `dummy:<model>`, one decode graph of one row over 1k tokens of random KV), then for each variant
overrides `fused_gemv.pick_config` for the named one-row shapes (`N,K:block_n,block_k,warps,stages`), recaptures
the graph and times the step. Every variant is printed as a ratio to the defaults measured in the same run (the
defaults run first and last: their spread is the noise). Results go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fp8_check import make, random_kv  # noqa: E402
from bench.roofline import give_rows, take_rows, timed  # noqa: E402
from common.engine.gpu import fused_gemv  # noqa: E402
from common.engine.gpu.cuda_graph import DecodeGraphs  # noqa: E402
from common.engine.gpu.fused_gemv import GemvConfig  # noqa: E402
from common.engine.runner import ModelRunner  # noqa: E402
from common.engine.sampling import argmax_rows  # noqa: E402

CTX = 1024
DEFAULT_TILES = (
    "qkv8x512=6144,4096:8,512,4,3;o4x1024=4096,4096:4,1024,4,3;down4x2048=4096,14336:4,2048,4,3;"
    "gate_up16x512=28672,4096:16,512,4,3;lm16x256=128256,4096:16,256,4,3"
)


def parse_tiles(spec: str) -> dict[str, dict[tuple[int, int], GemvConfig]]:
    """`NAME=N,K:bn,bk,warps,stages[+N,K:...];...` -> {name: {(n, k): config}}."""
    out: dict[str, dict[tuple[int, int], GemvConfig]] = {}
    for item in filter(None, spec.split(";")):
        name, shapes = item.split("=", 1)
        out[name] = {}
        for shape in shapes.split("+"):
            nk, cfg = shape.split(":")
            n, k = map(int, nk.split(","))
            out[name][(n, k)] = GemvConfig(*map(int, cfg.split(",")))
    return out


def step_ms(runner: ModelRunner, repeats: int) -> list[float]:
    rows = take_rows(runner, [CTX])
    batch = runner.build_batch([[5]], [CTX - 1], rows, [True], True)
    try:
        return [statistics.median(timed(lambda: argmax_rows(runner.forward(batch)), 20, 3)) for _ in range(repeats)]
    finally:
        give_rows(runner, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--weight-dtype", default="fp8_e4m3", help="auto (the model dtype) or fp8_e4m3")
    ap.add_argument("--kv-dtype", default="fp8_e4m3")
    ap.add_argument("--tiles", default=DEFAULT_TILES, help="variants: NAME=N,K:bn,bk,warps,stages[+...];...")
    ap.add_argument("--repeats", type=int, default=2, help="medians of 20 steps per variant")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    print(f"building dummy:{args.model} ({args.weight_dtype} weights, {args.kv_dtype} KV)", flush=True)
    runner = make(args.model, 8.0, 1, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype)  # one decode graph
    random_kv(runner)
    gpu = runner.gpu
    assert gpu is not None and gpu.graphs is not None, "needs the GPU path with decode graphs"
    default_pick = fused_gemv.pick_config
    variants = {"default": {}, **parse_tiles(args.tiles), "default again": {}}
    results: dict[str, list[float]] = {}
    for name, tiles in variants.items():

        def pick(rows: int, n: int, w_fp8: bool = False, k: int = 0, tiles=tiles) -> GemvConfig:
            return tiles[(n, k)] if rows == 1 and (n, k) in tiles else default_pick(rows, n, w_fp8, k)

        fused_gemv.pick_config = pick  # read when the graph is captured
        try:
            gpu.graphs = DecodeGraphs(
                gpu.model, gpu.attn, runner.pool, gpu.graphs.dummy_page, runner.page_table.table.shape[1], 1
            )
            results[name] = step_ms(runner, args.repeats)
        finally:
            fused_gemv.pick_config = default_pick
        print(f"{name:>16}: {' '.join(f'{t:.4f}' for t in results[name])} ms", flush=True)
    base = statistics.median(results["default"] + results["default again"])
    summary = {name: {"ms": ts, "ratio_to_default": statistics.median(ts) / base} for name, ts in results.items()}
    for name, r in summary.items():
        print(f"{name:>16}: {r['ratio_to_default']:.4f}x the default step time")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"model": args.model, "weight_dtype": args.weight_dtype, "steps": summary}, indent=1)
    )


if __name__ == "__main__":
    main()
