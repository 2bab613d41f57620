"""A mixture of experts on the GPU path beside the dense 8B (run on the GPU machine; dummy weights).

    python bench/moe.py --out OUT.json [--quick]

In one run: the device's copy bandwidth and GEMM rate (the ceilings), then for Qwen3-30B-A3B (128 experts,
top-8; experts as grouped GEMMs inside CUDA graphs, common/engine/gpu/moe_experts.py) and Llama-3.1-8B, decode
steps at batch 1/64/256 (1k context) and prefill of 1k and 4k prompts (bench/roofline.py's sections). The
decode floor counts only the weight bytes a step reads: of each MoE layer the experts its batch routes to
(k of E for one token). Decode steps of up to 8 tokens run the experts as GEMV kernels
(common/engine/gpu/moe_gemv.py) and the routing as one kernel (common/engine/gpu/moe_route.py); a MoE runner
with them off (`gemv_experts=False`: `route` and grouped GEMMs at every size) times b=1 first, as the baseline.
Prints the MoE's b=1 ratio to its floor with and without them (target >= 0.7), its steps' kernel time by
category, and its throughput beside the 8B's at each point.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import roofline  # noqa: E402

MODELS = ("qwen3-30b-a3b", "llama-3.1-8b")
BATCHES = (1, 64, 256)


def _section(name: str) -> None:
    runner = roofline.make_runner(name, kv_gb=40.0, max_seq_len=4096 + 64)
    # The MoE's kernel time by category at b=1 and b=256 (graph and eager): where its steps go beyond the floor.
    breakdowns = name == MODELS[0]
    roofline.decode_bench(runner, quick=ARGS.quick, batches=BATCHES, key_name=f"decode/{name}", breakdowns=breakdowns)
    roofline.prefill_bench(runner, quick=ARGS.quick)
    roofline.RESULTS[f"prefill/{name}"] = roofline.RESULTS.pop("prefill")
    del runner
    gc.collect()
    torch.cuda.empty_cache()


def _grouped_b1() -> None:
    """The MoE's b=1 decode with its experts as grouped GEMMs (the GEMV experts off), graphs up to batch 8."""
    moe = MODELS[0]
    label = f"{moe}-grouped-experts"
    runner = roofline.make_runner(moe, kv_gb=4.0, max_seq_len=4096 + 64, max_running=8, label=label, gemv_experts=False)
    roofline.decode_bench(runner, quick=ARGS.quick, batches=(1,), key_name=f"decode/{label}", breakdowns=True)
    del runner
    gc.collect()
    torch.cuda.empty_cache()


def compare() -> dict:
    r = roofline.RESULTS
    moe, dense = MODELS
    out: dict = {}
    for a, b in zip(r.get(f"decode/{moe}", []), r.get(f"decode/{dense}", [])):
        if "skipped" in a or "skipped" in b or a["ctx"] != 1024:
            continue
        out[f"decode_b{a['batch']}"] = dict(
            moe_step_ms=a["step_ms"],
            dense_step_ms=b["step_ms"],
            moe_ratio_to_floor=a["ratio"],
            moe_over_dense_tok_per_s=a["tok_per_s"] / b["tok_per_s"],
        )
    for a in r.get(f"decode/{moe}-grouped-experts", []):
        if "skipped" not in a and a["ctx"] == 1024:
            out["decode_b1_grouped_experts"] = dict(moe_step_ms=a["step_ms"], moe_ratio_to_floor=a["ratio"])
    for a, b in zip(r.get(f"prefill/{moe}", []), r.get(f"prefill/{dense}", [])):
        out[f"prefill_{a['tokens']}"] = dict(
            moe_tok_per_s=a["tok_per_s"], dense_tok_per_s=b["tok_per_s"], moe_over_dense=a["tok_per_s"] / b["tok_per_s"]
        )
    r["compare"] = out
    return out


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true")
    ARGS = ap.parse_args()
    roofline.OUT = ARGS.out
    logging.basicConfig(level=logging.WARNING)
    roofline.RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__, argv=sys.argv)
    roofline.ceilings(ARGS.quick)
    try:
        _grouped_b1()
        for name in MODELS:
            _section(name)
    finally:
        out = compare()
        roofline.save()
        print("\n== moe vs dense ==\n" + json.dumps(out, indent=1), flush=True)
        for key, experts in (
            ("decode_b1", "routing kernel + GEMV experts"),
            ("decode_b1_grouped_experts", "route + grouped GEMMs"),
        ):
            b1 = out.get(key)
            if b1:
                print(
                    f"qwen3-30b-a3b decode b=1, {experts}: {b1['moe_step_ms']:.3f} ms, "
                    f"{b1['moe_ratio_to_floor']:.2f} of its active-weight floor (target 0.7)"
                )


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
