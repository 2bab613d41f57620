"""Negative log-likelihood of a fixed text under the packaged SmolLM2: float32, bf16, FP8 KV, FP8 weights, both.

    python bench/fp8_nll.py --out OUT.json [--device cpu|cuda] [--tokens 6000]

The text is this repository's own docs (docs/*.md, then README.md), fixed by the commit, cut to `--tokens`
tokens and scored teacher-forced in windows of `--window` tokens (each window a fresh request; every token
but each window's first is predicted). Prints each variant's NLL and its increase over float32 and over bf16,
and greedy agreement (the share of positions whose argmax equals float32's, and bf16's).

On the CPU the FP8 variants run the twin (FP8 storage, float32 compute). On a GPU they run what serves there:
bf16 activations over FP8 KV pages (flashinfer's FP8 attention) and FP8 weights (FP8 GEMMs, the FP8 GEMV).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.default_model import convert_default_model  # noqa: E402
from common.engine.runner import ModelRunner, RunnerConfig  # noqa: E402
from common.offline import Engine  # noqa: E402
from common.settings import SchedulerConfig  # noqa: E402

VARIANTS = {
    "float32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "fp8_kv": dict(dtype="float32", kv_dtype="fp8_e4m3"),
    "fp8_weights": dict(dtype="float32", weight_dtype="fp8_e4m3"),
    "fp8_both": dict(dtype="float32", kv_dtype="fp8_e4m3", weight_dtype="fp8_e4m3"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--window", type=int, default=1024)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = convert_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    text = "\n\n".join(p.read_text() for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"])
    ids = tok.encode(text)[: args.tokens]
    assert len(ids) == args.tokens, f"the docs hold only {len(ids)} tokens"
    windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
    results: dict = {"tokens": len(ids), "window": args.window, "device": args.device, "variants": {}}
    ref_argmax: list[torch.Tensor] = []
    bf16_argmax: list[torch.Tensor] = []
    for name, fmt in VARIANTS.items():
        t0 = time.perf_counter()
        device_fmt = dict(fmt)
        if args.device == "cpu" and fmt["dtype"] == "bfloat16":
            device_fmt["attention"] = "torch"
        if args.device != "cpu" and name.startswith("fp8"):
            device_fmt["dtype"] = "bfloat16"
        runner = ModelRunner(
            RunnerConfig(model=str(path), device=args.device, num_pages=256, max_running=4, **device_fmt)
        )
        engine = Engine(runner=runner, sched_cfg=SchedulerConfig(max_prefill_tokens=2048), load_tokenizer=False)
        total, count, agree, agree_bf16 = 0.0, 0, 0, 0
        for w_i, w in enumerate(windows):
            logits = engine.score(w).float().cpu()
            total += F.cross_entropy(logits[:-1], torch.tensor(w[1:]), reduction="sum").item()
            count += len(w) - 1
            am = logits.argmax(-1)
            if name == "float32":
                ref_argmax.append(am)
            elif name == "bf16":
                bf16_argmax.append(am)
            agree += int((am == ref_argmax[w_i]).sum())
            if bf16_argmax:
                agree_bf16 += int((am == bf16_argmax[w_i]).sum())
        nll = total / count
        results["variants"][name] = dict(
            nll=nll,
            argmax_agreement_vs_fp32=agree / len(ids),
            argmax_agreement_vs_bf16=agree_bf16 / len(ids) if bf16_argmax else None,
            dtype=device_fmt["dtype"],
            seconds=time.perf_counter() - t0,
        )
        print(f"{name}: NLL {nll:.4f}, argmax agreement with float32 {agree / len(ids):.3f}", flush=True)
        del engine, runner
    base, bf16 = results["variants"]["float32"]["nll"], results["variants"]["bf16"]["nll"]
    for r in results["variants"].values():
        r["nll_increase_vs_fp32"] = r["nll"] / base - 1
        r["nll_increase_vs_bf16"] = r["nll"] / bf16 - 1
    args.out.write_text(json.dumps(results, indent=2))
    for name, r in results["variants"].items():
        print(
            f"{name:>12}: NLL {r['nll']:.4f}  vs float32 {100 * r['nll_increase_vs_fp32']:+.2f}%  "
            f"vs bf16 {100 * r['nll_increase_vs_bf16']:+.2f}%  argmax agreement {r['argmax_agreement_vs_fp32']:.3f}"
            + (f" (with bf16 {r['argmax_agreement_vs_bf16']:.3f})" if r["argmax_agreement_vs_bf16"] else "")
        )


if __name__ == "__main__":
    main()
