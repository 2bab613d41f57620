"""FP8 weights and FP8 KV against bf16 and a float32 reference on one GPU (run on the GPU machine).

    python bench/fp8_check.py --out OUT.json [--model llama-3.1-8b] [--quick] [--profile] [--variants bf16,fp8_kv]

Random weights of the model's shapes (`dummy:<model>`), one engine per variant, built one at a time:
- accuracy: teacher-forced logits of one random 512-token prompt against the float32 engine (torch path on the
  GPU): relative L2 error and argmax agreement for bf16, FP8 weights, FP8 KV and both;
- speed: decode step b=1 and b=256 at 1k context (CUDA graphs), one 4k-token prefill, KV bytes per token;
  each FP8 variant as a ratio to bf16 measured in this run, decode b=1 also against its bandwidth floor (every
  weight read once, GEMM weights at one byte for FP8 weights, plus the KV read).
The `*_unfused` variants run an FP8 variant as the engine did before FP8 queries on FA3 (prefill attention over FP8
pages on flashinfer's FA2 kernel) and before the fused activation quantization (the norm and SiLU-mul write 16-bit
rows that a second kernel quantizes): the same engine with those two paths turned off, for an A/B in one run.
A variant may carry engine settings after its name, `NAME+field=value+...` (RunnerConfig fields), e.g.
`fp8_both+pdl=0` (plain launches) or `bf16+gemv_max_rows=4`; `--speed-only` skips the float32
reference and the accuracy columns.
Results are written to --out after each variant; the summary table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import roofline  # noqa: E402
from bench.roofline import give_rows, take_rows, timed, weight_bytes  # noqa: E402
from common.engine.runner import ModelRunner, RunnerConfig  # noqa: E402
from common.engine.sampling import argmax_rows  # noqa: E402

VARIANTS = {
    "bf16": dict(dtype="bfloat16"),
    "fp8_weights": dict(dtype="bfloat16", weight_dtype="fp8_e4m3"),
    "fp8_kv": dict(dtype="bfloat16", kv_dtype="fp8_e4m3"),
    "fp8_both": dict(dtype="bfloat16", weight_dtype="fp8_e4m3", kv_dtype="fp8_e4m3"),
}
UNFUSED = "_unfused"
VARIANTS.update({name + UNFUSED: VARIANTS[name] for name in ("fp8_weights", "fp8_kv", "fp8_both")})
PROMPT_LEN = 512
CTX = 1024
# Kernel names -> what they are, for --profile's per-step breakdown (first match wins).
KERNEL_KINDS = [
    ("norm/act + quantize", ("_add_rms_norm_quant", "_silu_mul_quant")),
    ("quantize", ("quantize_rows", "_saturate")),
    ("gemv", ("_gemv_kernel",)),
    ("attention", ("decode_attention", "BatchDecode", "BatchPrefill", "Prefill", "Decode", "MergeState", "kernel_mha")),
    ("gemm", ("gemm", "Gemm", "cutlass", "nvjet", "sm90_xmma", "scaled_mm", "cublas")),
    ("norm", ("rmsnorm", "RMSNorm", "Norm")),
    ("rope+kv write", ("rope", "Rope")),
    ("activation", ("silu", "act_and_mul")),
]


def kind_of(name: str) -> str:
    for kind, keys in KERNEL_KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def kernel_breakdown(fn, calls: int = 3) -> dict:
    """Device time per call by kernel kind, and the ten costliest kernels (us per call), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if us > 0 and ev.key not in ("cudaGraphLaunch",):
            per_kernel[ev.key] = per_kernel.get(ev.key, 0.0) + us / calls
    kinds: dict[str, float] = {}
    for name, us in per_kernel.items():
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:10]
    return {
        "total_us": round(sum(per_kernel.values()), 1),
        "by_kind_us": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_kernels_us": [[name[:90], round(us, 1)] for name, us in top],
    }


@contextlib.contextmanager
def unfused_fp8(on: bool):
    """Within: FP8 pools prefill on FA2 with 16-bit queries, and FP8 GEMMs quantize their activations themselves."""
    if not on:
        yield
        return
    from common.engine.gpu import attention
    from common.engine.gpu.ops import FlashInferOps

    supported, fused = attention.fp8_prefill_supported, FlashInferOps._fp8_gemm
    attention.fp8_prefill_supported = lambda *a: False
    FlashInferOps._fp8_gemm = lambda *a: False
    try:
        yield
    finally:
        attention.fp8_prefill_supported, FlashInferOps._fp8_gemm = supported, fused


def log(msg: str) -> None:
    print(msg, flush=True)


def make(model: str, kv_gb: float, max_running: int, **fmt: str) -> ModelRunner:
    cfg = RunnerConfig(
        model=f"dummy:{model}",
        device="cuda",
        kv_memory_gb=kv_gb,
        max_running=max_running,
        max_seq_len=8192,
        cuda_graph_max_bs=max_running if fmt.get("dtype") != "float32" else 0,
        **fmt,
    )
    return ModelRunner(cfg)


@torch.inference_mode()
def score(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    rows = take_rows(runner, [len(ids)])
    fb = runner.build_batch([ids], [0], rows, [True], False, all_logits=True)
    logits = runner.forward(fb).float()
    torch.cuda.synchronize()
    give_rows(runner, rows)
    return logits


def random_kv(runner: ModelRunner) -> None:
    """Random values in the whole KV pool (16-bit or e4m3): never time attention on zeros."""
    for block in runner.pool.kv.split(4096):
        if block.dtype == torch.float8_e4m3fn:
            block.copy_(torch.randn(block.shape, device=block.device).to(block.dtype))
        else:
            block.normal_()


@torch.inference_mode()
def speed(runner: ModelRunner, quick: bool, profile: bool = False) -> dict:
    mc = runner.model_config
    iters = 10 if quick else 30
    random_kv(runner)
    out: dict = {}
    for b in (1, 256):
        rows = take_rows(runner, [CTX] * b)
        ids = torch.randint(0, mc.vocab_size, (b,)).tolist()
        fb = runner.build_batch([[t] for t in ids], [CTX - 1] * b, rows, [True] * b, True)
        t = statistics.median(timed(lambda fb=fb: argmax_rows(runner.forward(fb)), iters, 3))
        out[f"decode_b{b}_ms"] = t
        out[f"decode_b{b}_tok_per_s"] = b / (t * 1e-3)
        out[f"decode_b{b}_kv_bytes"] = b * CTX * runner.layout.bytes_per_token
        if profile:
            out[f"decode_b{b}_kernels"] = kernel_breakdown(lambda fb=fb: argmax_rows(runner.forward(fb)))
        give_rows(runner, rows)
    n = 4096
    rows = take_rows(runner, [n])
    ids = torch.randint(0, mc.vocab_size, (n,)).tolist()
    fb = runner.build_batch([ids], [0], rows, [True], False)
    t = statistics.median(timed(lambda fb=fb: runner.forward(fb), 3 if quick else 6, 2))
    if profile:
        out["prefill_4k_kernels"] = kernel_breakdown(lambda fb=fb: runner.forward(fb), calls=2)
    give_rows(runner, rows)
    out["prefill_4k_ms"] = t
    out["prefill_4k_tok_per_s"] = n / (t * 1e-3)
    out["kv_bytes_per_token"] = runner.layout.bytes_per_token
    out["weight_bytes_b1"] = weight_bytes(runner, 1)
    bw = roofline.RESULTS["ceilings"]["copy_bytes_per_s"]
    out["decode_b1_floor_ms"] = (out["weight_bytes_b1"] + out["decode_b1_kv_bytes"]) / bw * 1e3
    out["decode_b1_ratio_to_floor"] = out["decode_b1_floor_ms"] / out["decode_b1_ms"]
    return out


def variant_settings(spec: str) -> dict:
    """`NAME+field=value+...` -> the RunnerConfig keyword arguments (the variant's, then the fields given)."""
    name, *extra = spec.split("+")
    fields = {f.name: f.type for f in dataclasses.fields(RunnerConfig)}
    kw = dict(VARIANTS[name])
    parse = {"bool": lambda v: v in ("1", "true", "on"), "int": int, "float": float}
    for item in extra:
        key, value = item.split("=", 1)
        kw[key] = parse.get(str(fields[key]), str)(value)
    return kw


def check(name: str, args: argparse.Namespace, ids: list[int], ref: torch.Tensor | None) -> dict:
    """One variant's accuracy against the float32 logits `ref` (where given) and its speed."""
    runner = make(args.model, args.kv_gb, 256, **variant_settings(name))
    r: dict = {}
    if ref is not None:
        got = score(runner, ids)
        r.update(
            logits_rel_err_vs_fp32=float((got - ref).norm() / ref.norm()),
            argmax_agreement_vs_fp32=float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        )
        log(f"{name}: logits rel err {r['logits_rel_err_vs_fp32']:.3e}, argmax {r['argmax_agreement_vs_fp32']:.3f}")
    r.update(
        kv_dtype=str(runner.pool.kv.dtype),
        fp8_weights=runner.model.fp8_weights,
        fp8_prefill_fa3=bool(getattr(runner.attn, "fp8_prefill", False)),
        pdl=bool(getattr(runner.gpu, "pdl", False)),
    )
    r.update(speed(runner, args.quick, args.profile))
    log(f"{name}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--kv-gb", type=float, default=40.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="device time by kernel kind for each timed case")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help="which of " + ",".join(VARIANTS) + " (each NAME[+field=value])"
    )
    ap.add_argument("--speed-only", action="store_true", help="no float32 reference, no accuracy columns")
    args = ap.parse_args()
    results: dict = {"model": args.model, "prompt_tokens": PROMPT_LEN, "ctx": CTX, "variants": {}}
    torch.manual_seed(0)
    roofline.ceilings(quick=True)
    results["ceilings"] = roofline.RESULTS["ceilings"]

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=2))

    ids: list[int] = []
    ref = None
    if not args.speed_only:
        ref_runner = make(args.model, 2.0, 4, dtype="float32", attention="torch")
        ids = torch.randint(0, ref_runner.model_config.vocab_size, (PROMPT_LEN,)).tolist()
        ref = score(ref_runner, ids)
        del ref_runner
        gc.collect()
        torch.cuda.empty_cache()
    for name in args.variants.split(","):
        with unfused_fp8(name.split("+")[0].endswith(UNFUSED)):
            r = check(name, args, ids, ref)
        results["variants"][name] = r
        save()
        gc.collect()
        torch.cuda.empty_cache()
    base = results["variants"].get("bf16") or next(iter(results["variants"].values()))
    lines = [
        f"{'variant':>20} | err vs fp32 | argmax | dec b1 ms (floor ratio) | b256 tok/s (x bf16) | prefill 4k ms (x bf16) | KV B/tok"
    ]
    for name, r in results["variants"].items():
        r["decode_b256_speedup_vs_bf16"] = r["decode_b256_tok_per_s"] / base["decode_b256_tok_per_s"]
        r["decode_b1_speedup_vs_bf16"] = base["decode_b1_ms"] / r["decode_b1_ms"]
        r["prefill_4k_speedup_vs_bf16"] = base["prefill_4k_ms"] / r["prefill_4k_ms"]
        r["kv_bytes_ratio_vs_bf16"] = r["kv_bytes_per_token"] / base["kv_bytes_per_token"]
        lines.append(
            f"{name:>20} | {r.get('logits_rel_err_vs_fp32', float('nan')):.2e} | "
            f"{r.get('argmax_agreement_vs_fp32', float('nan')):.3f} | "
            f"{r['decode_b1_ms']:.3f} ({r['decode_b1_ratio_to_floor']:.2f}) | "
            f"{r['decode_b256_tok_per_s']:.0f} ({r['decode_b256_speedup_vs_bf16']:.2f}x) | "
            f"{r['prefill_4k_ms']:.1f} ({r['prefill_4k_speedup_vs_bf16']:.2f}x) | {r['kv_bytes_per_token']}"
        )
    save()
    log("\n".join(lines))


if __name__ == "__main__":
    main()
