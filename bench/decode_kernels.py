"""The small-batch decode kernels one by one, against cuBLAS / flashinfer and against the copy ceiling.

    python bench/decode_kernels.py --out OUT.json [--quick]

For the llama-3.1-8b shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, LM head
128256x4096) at 1/2/4/8 rows: cuBLAS (`F.linear`) and the Triton GEMV (common/engine/gpu/fused_gemv.py) over a
sweep of block shapes, each timed as 32 calls on 32 distinct weight copies inside one CUDA graph (so weights
stream from HBM as in a model, not from L2). Reported per shape: time per call, GB/s of weight read, the ratio
to the copy ceiling measured in this run, and Triton / cuBLAS. Sections (`--sections`):
- gemv: the sweep above; prologue: the GEMV with each shape's norm / SiLU-mul folded in vs plain vs cuBLAS + op;
- layer: RoPE + K/V write per layer at batch 1 and 8 (Triton's one kernel vs flashinfer's RoPE + two index_copy);
- attention: decode attention per layer, flashinfer's graph-mode wrappers (tensor cores, CUDA cores) vs the
  split-KV Triton kernel, batch 1-32 at 1k and 4k context; with `--kv-dtypes fp8` FP8 pages at batch 1-256, and
  XQA's FP8 kernel beside them (common/engine/gpu/xqa_decode.py; skipped where it does not build).
`--weight-dtypes fp8` runs the GEMV sweep over FP8 weights against per-token quantization + a scaled GEMM.
Every Triton and XQA result is checked against cuBLAS / flashinfer on the same inputs first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.gpu.fused_gemv import GemvConfig, gemv, pick_config  # noqa: E402

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
SWEEP_ONE = [
    GemvConfig(bn, bk, w, st)
    for bn, bk, w, st in [
        (16, 256, 4, 3),
        (8, 256, 4, 3),
        (8, 512, 4, 3),
        (16, 512, 4, 3),
        (16, 512, 8, 3),
        (32, 256, 4, 3),
        (32, 256, 8, 3),
        (4, 1024, 4, 3),
        (8, 1024, 8, 2),
        (16, 128, 4, 5),
        (32, 128, 4, 4),
        (64, 128, 8, 3),
    ]
]
# FP8 weights stream half the bytes per tile: the sweep leans to wider K tiles and more rows per program.
SWEEP_ONE_FP8 = [
    GemvConfig(bn, bk, w, st)
    for bn, bk, w, st in [
        (8, 512, 4, 3),
        (8, 256, 4, 3),
        (8, 1024, 4, 3),
        (8, 1024, 8, 3),
        (16, 512, 4, 3),
        (16, 1024, 4, 3),
        (16, 1024, 8, 3),
        (32, 512, 8, 3),
        (4, 2048, 4, 3),
        (8, 2048, 8, 2),
        (16, 256, 4, 4),
        (32, 256, 4, 4),
    ]
]
SWEEP_FEW = [
    GemvConfig(bn, bk, w, st)
    for bn, bk, w, st in [
        (64, 128, 4, 4),
        (64, 64, 4, 5),
        (64, 256, 4, 3),
        (128, 64, 4, 4),
        (128, 128, 4, 3),
        (128, 128, 8, 4),
        (64, 128, 8, 4),
    ]
]
RESULTS: dict = {}


def graph_time(fn, iters: int = 20) -> float:
    """Median ms of one replay of a graph that runs `fn` once (fn launches many kernels)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: compilation, lazy init
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_ceiling() -> float:
    x = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB, as bench/roofline.py measures it
    y = torch.empty_like(x)
    t = graph_time(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / (t * 1e-3)


def bench_gemv(quick: bool, weight_dtype: str) -> None:
    """The GEMV sweep with bf16 weights (against cuBLAS) or FP8 weights with row scales (against the engine's
    FP8 alternative: per-token quantization + the row-wise scaled tensor-core GEMM; the LM head stays 16-bit in
    FP8 models, so it is left out)."""
    from common.engine.fp8 import Fp8Linear, quantize_rows
    from common.engine.gpu.fp8_gemm import fp8_linear

    fp8 = weight_dtype == "fp8"
    bw = RESULTS["copy_bytes_per_s"]
    rows_out = []
    for name, (n, k) in SHAPES.items():
        if fp8 and name == "lm_head":
            continue
        nbytes = n * k * (1 if fp8 else 2)
        copies = 32 if nbytes * 32 < 12e9 else 4
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        packed = [Fp8Linear(q, s.squeeze(1)) for q, s in map(quantize_rows, ws)] if fp8 else []
        if fp8:
            ws = [p.weight for p in packed]
        scale_of = {id(p.weight): p.scale for p in packed}

        def run(x, w, cfg=None, scale_of=scale_of):
            return gemv(x, w, config=cfg, weight_scale=scale_of.get(id(w)))

        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            if fp8:
                ref = F.linear(x, packed[0].dequantize(torch.float32).to(torch.bfloat16)).float()
                t_cublas = graph_time(lambda x=x, packed=packed: [fp8_linear(x, p) for p in packed]) / copies
            else:
                ref = F.linear(x, ws[0]).float()
                t_cublas = graph_time(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]) / copies
            sweep = (SWEEP_ONE_FP8 if fp8 else SWEEP_ONE) if m == 1 else SWEEP_FEW
            if quick:
                sweep = [pick_config(m, n, fp8, k)]
            best = None
            per_cfg = {}
            for cfg in sweep:
                y, _ = run(x, ws[0], cfg)
                err = float((y.float() - ref).norm() / ref.norm())
                if not err < 1e-2:
                    per_cfg[str(cfg)] = f"wrong: rel err {err:.2e}"
                    continue
                t = graph_time(lambda cfg=cfg, x=x, ws=ws: [run(x, w, cfg) for w in ws]) / copies
                per_cfg[f"{cfg.block_n}x{cfg.block_k}/w{cfg.num_warps}/s{cfg.num_stages}"] = round(t * 1e3, 2)
                if best is None or t < best[0]:
                    best = (t, cfg)
            assert best is not None
            t_default = graph_time(lambda x=x, ws=ws: [run(x, w) for w in ws]) / copies
            r = dict(
                weights=weight_dtype,
                shape=name,
                n=n,
                k=k,
                rows=m,
                cublas_us=t_cublas * 1e3,
                triton_default_us=t_default * 1e3,
                triton_best_us=best[0] * 1e3,
                best_config=str(best[1]),
                cublas_of_copy=nbytes / (t_cublas * 1e-3) / bw,
                triton_default_of_copy=nbytes / (t_default * 1e-3) / bw,
                triton_best_of_copy=nbytes / (best[0] * 1e-3) / bw,
                triton_default_vs_cublas=t_cublas / t_default,
                sweep_us=per_cfg,
            )
            rows_out.append(r)
            print(
                f"{weight_dtype} {name:>8} m={m}: {'scaled GEMM' if fp8 else 'cuBLAS'} {t_cublas * 1e3:7.1f} us ({r['cublas_of_copy']:.2f} of copy)  "
                f"triton default {t_default * 1e3:7.1f} us ({r['triton_default_of_copy']:.2f})  best {best[0] * 1e3:7.1f} us "
                f"{best[1]}  default/cuBLAS speed {r['triton_default_vs_cublas']:.2f}",
                flush=True,
            )
            RESULTS[f"gemv_{weight_dtype}"] = rows_out
            save()
        ws.clear()
        torch.cuda.empty_cache()


def bench_prologues() -> None:
    """What folding each shape's own prologue costs: the GEMV with it vs without it vs cuBLAS + the separate op."""
    import flashinfer

    natural = {"qkv": "add_norm", "gate_up": "add_norm", "down": "silu", "lm_head": "add_norm"}
    rows_out = []
    for name, prologue in natural.items():
        n, k = SHAPES[name]
        copies = 32 if n * k * 2 * 32 < 12e9 else 4
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 8):
            width = 2 * k if prologue == "silu" else k
            x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xk = x[:, :k].contiguous()

            def folded(x=x, r=r, ws=ws, prologue=prologue, nw=nw):
                for w in ws:
                    gemv(x, w, prologue=prologue, residual=r if prologue == "add_norm" else None, norm_weight=nw)

            def plain_triton(xk=xk, ws=ws):
                for w in ws:
                    gemv(xk, w)

            def separate(x=x, r=r, ws=ws, prologue=prologue, nw=nw):
                for w in ws:
                    if prologue == "silu":
                        a = flashinfer.silu_and_mul(x)
                    else:
                        a, rr = x.clone(), r.clone()
                        flashinfer.fused_add_rmsnorm(a, rr, nw, 1e-6)
                    F.linear(a, w)

            t_f, t_p, t_s = (graph_time(f) / copies * 1e3 for f in (folded, plain_triton, separate))
            row = dict(shape=name, rows=m, prologue=prologue, folded_us=t_f, plain_triton_us=t_p, cublas_plus_op_us=t_s)
            rows_out.append(row)
            print(
                f"{name:>8} m={m} {prologue}: folded {t_f:6.1f} us, plain Triton {t_p:6.1f} us, "
                f"cuBLAS + op {t_s:6.1f} us (the op's clones included)",
                flush=True,
            )
        ws.clear()
        torch.cuda.empty_cache()
    RESULTS["prologues"] = rows_out
    save()


def fill_random(block: torch.Tensor) -> None:
    if block.dtype == torch.float8_e4m3fn:
        block.copy_(torch.randn(block.shape, device=block.device).to(block.dtype))
    else:
        block.normal_()


# (pages per tile, warps, stages) for the Triton kernel's sweep; the first is its default.
ATTN_TILES = [(4, 4, 2), (4, 4, 3), (8, 4, 2), (8, 8, 2), (2, 4, 3)]


def xqa_attention(q, bufs, ps: int, hkv: int, ks: float, vs: float):
    """The engine's XQA path (common/engine/gpu/xqa_decode.py) over one layer's (K, V), its page table derived
    from the CSR buffers as a decode graph does: a function of the layer's caches, or None where it is not
    supported here."""
    from common.engine.gpu import xqa_decode

    if not xqa_decode.supported(q.device, torch.float8_e4m3fn, ps, q.shape[-1]):
        print("xqa: not supported here", flush=True)
        return None
    indptr, indices, last = bufs
    xqa = xqa_decode.XqaDecode(q.device, hkv, ps, int(indptr[1] - indptr[0]))
    pages = xqa.pages(indptr, indices, last)
    out = torch.empty_like(q)
    return lambda kv: xqa.attend(q, kv[0], kv[1], ks, vs, pages, out)


XQA_FAILED: list[str] = []  # a build failure is reported once, not retried per shape


def bench_attention(kv_dtype: str, quick: bool) -> None:
    """Decode attention per layer: flashinfer's graph-mode wrappers (tensor cores, as the engine builds them,
    and CUDA cores) vs the split-KV Triton kernel over a sweep of tiles, 32 layers' pools in one graph; outputs
    compared with flashinfer's. bf16 pages at batch 1-32; FP8 pages (static scales) at batch 1-256."""
    import flashinfer

    from common.engine.gpu import decode_attention as tda
    from common.kv.pool import KVLayout, KVPool

    fp8 = kv_dtype == "fp8"
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    hq, hkv, d, layers, ps = 32, 8, 128, 32, 16
    ks, vs = (0.5, 0.25) if fp8 else (1.0, 1.0)
    scales = dict(k_scale=ks, v_scale=vs) if fp8 else {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    batches = (1, 2, 4, 8, 16, 32, 64, 128, 256) if fp8 else (1, 2, 4, 8, 16, 32)
    tiles = [tda.TileConfig()] if quick else [tda.TileConfig(*t) for t in ATTN_TILES]
    out = {}
    for ctx in (1024, 4096):
        for b in batches:
            if ctx * b > 64 * 4096:
                continue
            npages = ctx // ps
            layout = KVLayout(layers, hkv, d, ps, dtype, (ks, vs) * layers if fp8 else ())
            pool = KVPool(layout, b * npages + 8, torch.device("cuda"))
            for blk in pool.kv.split(1024):
                fill_random(blk)
            indptr = torch.arange(0, (b + 1) * npages, npages, dtype=torch.int32)
            indices = torch.randperm(b * npages, device="cuda").to(torch.int32)
            last = torch.full((b,), ps, dtype=torch.int32)
            bufs = (indptr.cuda(), indices.clone(), last.cuda())
            q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
            kvs = [(pool.k_cache(i), pool.v_cache(i)) for i in range(layers)]
            times = {}
            ref = None
            for tc in (True, False):
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws,
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=tc,
                    paged_kv_indptr_buffer=bufs[0],
                    paged_kv_indices_buffer=bufs[1],
                    paged_kv_last_page_len_buffer=bufs[2],
                    backend="fa2",
                )
                w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=torch.bfloat16, kv_data_type=dtype)
                if ref is None:
                    ref = w.run(q, kvs[0], **scales).float()
                times["flashinfer_tc" if tc else "flashinfer_cuda_cores"] = (
                    graph_time(lambda w=w, kvs=kvs, q=q: [w.run(q, kv, **scales) for kv in kvs]) / layers
                )
            splits = tda.num_splits(b, hkv, sms)
            errs = {}
            xqa_run = xqa_attention(q, bufs, ps, hkv, ks, vs) if fp8 and not XQA_FAILED else None
            if xqa_run is not None:
                try:
                    errs["xqa"] = float((xqa_run(kvs[0]).float() - ref).norm() / ref.norm())
                    times["xqa"] = graph_time(lambda run=xqa_run, kvs=kvs: [run(kv) for kv in kvs]) / layers
                except Exception as exc:  # a JIT build failure: keep the rest of the sweep
                    XQA_FAILED.append(f"{type(exc).__name__}: {str(exc)[:600]}")
                    print(f"xqa failed: {XQA_FAILED[0]}", flush=True)
            for tile in tiles:
                got = tda.decode_attention(q, *kvs[0], *bufs, splits, ks, vs, tile).float()
                name = f"triton_ppt{tile.pages_per_tile}_w{tile.num_warps}_s{tile.num_stages}"
                errs[name] = float((got - ref).norm() / ref.norm())
                times[name] = (
                    graph_time(
                        lambda kvs=kvs, q=q, bufs=bufs, s=splits, t=tile: [
                            tda.decode_attention(q, *kv, *bufs, s, ks, vs, t) for kv in kvs
                        ]
                    )
                    / layers
                )
            kv_bytes = b * ctx * hkv * d * 2 * pool.kv.element_size()
            key = f"{kv_dtype}_b{b}_ctx{ctx}"
            fi_best = min(times["flashinfer_tc"], times["flashinfer_cuda_cores"])
            tr_name = min((n for n in times if n.startswith("triton")), key=times.__getitem__)
            out[key] = dict(
                us={n: t * 1e3 for n, t in times.items()},
                of_copy={n: kv_bytes / (t * 1e-3) / RESULTS["copy_bytes_per_s"] for n, t in times.items()},
                triton_default_vs_flashinfer_tc=times["flashinfer_tc"]
                / times[next(n for n in times if n.startswith("triton"))],
                triton_best=tr_name,
                triton_best_vs_flashinfer_best=fi_best / times[tr_name],
                xqa_vs_flashinfer_tc=times["flashinfer_tc"] / times["xqa"] if "xqa" in times else None,
                splits=splits,
                rel_diff=errs,
                kv_bytes=kv_bytes,
            )
            print(
                f"attention {key}: "
                + ", ".join(f"{n} {t * 1e3:.1f} us ({out[key]['of_copy'][n]:.2f})" for n, t in times.items())
                + f"; best triton / best flashinfer {fi_best / times[tr_name]:.2f}x, {splits} splits, "
                f"max rel diff {max(errs.values()):.1e}",
                flush=True,
            )
            del pool, kvs
            torch.cuda.empty_cache()
            RESULTS[f"attention_{kv_dtype}"] = out
            save()


def bench_layer_ops() -> None:
    """Per-layer small kernels at batch 1 (1k context), 32 layers' worth in one graph."""
    import flashinfer

    from common.engine.gpu.rope_store import rope_store
    from common.engine.layers import RotaryCache
    from common.engine.model_config import RopeConfig
    from common.kv.pool import KVLayout, KVPool

    hq, hkv, d, layers, ctx, ps = 32, 8, 128, 32, 1024, 16
    rotary = RotaryCache.build(d, RopeConfig(theta=500000.0), 8192, torch.device("cuda"))
    cos_sin = rotary.cos_sin()
    pages = ctx // ps
    pool = KVPool(KVLayout(layers, hkv, d, ps, torch.bfloat16), pages * 8 + 8, torch.device("cuda"))
    pool.kv.normal_()
    out = {}
    for b in (1, 8):
        qkv = torch.randn(b, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
        q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
        pos = torch.full((b,), ctx - 1, device="cuda", dtype=torch.int64)
        rows = pool.token_rows(torch.arange(b, device="cuda") * ps * 4 + ctx - 1)

        def fused(pos=pos, q=q, k=k, v=v, rows=rows):
            for i in range(layers):
                rope_store(pos, q, k, v, cos_sin, pool.rows, rows, pool.layer_offset(i, 0), pool.layer_offset(i, 1))

        def unfused(pos=pos, q=q, k=k, v=v, rows=rows, b=b):
            for i in range(layers):
                qr, kr = flashinfer.apply_rope_with_cos_sin_cache(pos, q.flatten(1), k.flatten(1), d, cos_sin, True)
                pool.rows.index_copy_(0, rows + pool.layer_offset(i, 0), kr.view(b, hkv, d))
                pool.rows.index_copy_(0, rows + pool.layer_offset(i, 1), v)

        tf, tu = graph_time(fused) / layers, graph_time(unfused) / layers
        out[f"rope_store_b{b}"] = dict(fused_us=tf * 1e3, unfused_us=tu * 1e3, speedup=tu / tf)
        print(f"rope+kv write b={b}: fused {tf * 1e3:.2f} us/layer, unfused {tu * 1e3:.2f} us/layer ({tu / tf:.2f}x)")
    RESULTS["layer_ops"] = out
    save()


OUT: Path | None = None


def save() -> None:
    if OUT is not None:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(RESULTS, indent=1, default=str))


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "decode_kernels.json")
    ap.add_argument("--quick", action="store_true", help="only the default Triton configs")
    ap.add_argument("--sections", default="gemv,prologue,layer,attention")
    ap.add_argument("--kv-dtypes", default="bf16", help="attention pages: bf16, fp8 or both (bf16,fp8)")
    ap.add_argument("--weight-dtypes", default="bf16", help="GEMV weights: bf16, fp8 or both (bf16,fp8)")
    args = ap.parse_args()
    OUT = args.out
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["copy_bytes_per_s"] = copy_ceiling()
    print(f"copy ceiling {RESULTS['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    if "gemv" in args.sections:
        for wd in args.weight_dtypes.split(","):
            bench_gemv(args.quick, wd)
    if "prologue" in args.sections:
        bench_prologues()
    if "layer" in args.sections:
        bench_layer_ops()
    if "attention" in args.sections:
        for kv in args.kv_dtypes.split(","):
            bench_attention(kv, args.quick)
    save()


if __name__ == "__main__":
    main()
