"""The prefill GEMMs of an 8B model in bf16 and FP8, over the ways torch's scaled matmul can run them.

    python bench/fp8_gemm.py --out OUT.json [--rows 512,4096]

For the llama-3.1-8b shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) at `--rows` tokens:
bf16 `F.linear` (the baseline), and e4m3 `torch._scaled_mm` with row-wise scales (per token x per output channel,
what common/engine/gpu/fp8_gemm.py runs) or one scale per tensor, each with and without fast accumulation (Hopper's
FP8 MMA accumulates in reduced precision unless the kernel promotes the partial sums to float32 every few K
steps; the fast variants skip the promotion). Each is timed as the median of CUDA-event runs over distinct weight
copies (weights stream from HBM, not L2) and checked against a float32 matmul of the same quantized operands:
relative L2 error, so what fast accumulation costs in accuracy is printed beside what it saves. Reported: ms,
TFLOP/s, and the speed-up over bf16 in this run, per shape and summed over one layer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.roofline import device_ms, log  # noqa: E402
from common.engine.fp8 import quantize_rows  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 4
VARIANTS = ("bf16", "rowwise", "rowwise_fast", "tensor", "tensor_fast")


def make_call(variant: str, x: torch.Tensor, ws: list[torch.Tensor], xq, sx, wqs, sws):
    """fn(copy) -> [M, N] bf16 for one variant."""
    if variant == "bf16":
        return lambda i: F.linear(x, ws[i])
    fast = variant.endswith("_fast")
    if variant.startswith("rowwise"):
        return lambda i: torch._scaled_mm(
            xq, wqs[i].t(), scale_a=sx, scale_b=sws[i].view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=fast
        )
    # One scale per tensor: the largest row scale (what a static per-tensor recipe would calibrate to).
    xt, st = per_tensor(x)
    wts = [per_tensor(w) for w in ws]
    return lambda i: torch._scaled_mm(
        xt, wts[i][0].t(), scale_a=st, scale_b=wts[i][1], out_dtype=torch.bfloat16, use_fast_accum=fast
    )


def per_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (t.abs().amax().float() / 448.0).clamp(min=1e-12)
    return (t.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reshape(())


def reference(variant: str, x, ws, xq, sx, wqs, sws) -> torch.Tensor:
    """float32 product of the operands the variant multiplies (bf16's own inputs for bf16)."""
    if variant == "bf16":
        return x.float() @ ws[0].float().t()
    if variant.startswith("rowwise"):
        return (xq.float() * sx) @ (wqs[0].float() * sws[0][:, None]).t()
    xt, st = per_tensor(x)
    wt, sw = per_tensor(ws[0])
    return (xt.float() * st) @ (wt.float() * sw).t()


def run_shape(name: str, n: int, k: int, m: int, iters: int, variants: list[str]) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1234 + n + k + m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5 for _ in range(COPIES)]
    xq, sx = quantize_rows(x)
    wq = [quantize_rows(w) for w in ws]
    wqs, sws = [q for q, _ in wq], [s.view(-1) for _, s in wq]
    flops = 2.0 * m * n * k
    row: dict = {"shape": name, "n": n, "k": k, "rows": m}
    for v in variants:
        try:
            fn = make_call(v, x, ws, xq, sx, wqs, sws)
            out = fn(0).float()
            ref = reference(v, x, ws, xq, sx, wqs, sws)
            err = float((out - ref).norm() / ref.norm())
            copies = itertools.cycle(range(COPIES))
            ms = device_ms(lambda fn=fn, copies=copies: fn(next(copies)), iters)
        except Exception as exc:  # a variant this torch / GPU does not run
            log(f"  {name} m={m} {v}: unavailable ({str(exc)[:160]})")
            row[v] = {"error": str(exc)[:300]}
            continue
        row[v] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": err}
    base = row.get("bf16", {}).get("ms")
    for v in variants:
        if base and "ms" in row[v]:
            row[v]["speedup_vs_bf16"] = base / row[v]["ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="512,4096")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/fp8_gemm.py needs a CUDA GPU")
    variants = args.variants.split(",")
    rows = []
    summary: dict = {}
    for m in (int(r) for r in args.rows.split(",")):
        layer = dict.fromkeys(variants, 0.0)
        for name, (n, k) in SHAPES.items():
            r = run_shape(name, n, k, m, args.iters, variants)
            rows.append(r)
            cells = "  ".join(
                f"{v} {r[v]['ms']:.3f} ms x{r[v].get('speedup_vs_bf16', 0):.2f} err {r[v]['rel_err']:.1e}"
                for v in variants
                if "ms" in r[v]
            )
            log(f"m={m:5d} {name:8s} {cells}")
            for v in variants:
                layer[v] += r[v].get("ms", float("nan"))
        summary[str(m)] = {v: {"layer_ms": ms, "speedup_vs_bf16": layer["bf16"] / ms} for v, ms in layer.items()}
        log(
            f"m={m:5d} one layer: " + "  ".join(f"{v} {ms:.3f} ms x{layer['bf16'] / ms:.2f}" for v, ms in layer.items())
        )
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "layer": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
