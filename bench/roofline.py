"""The GPU path against the device's roofline (run on the GPU machine).

    python bench/roofline.py --out OUT.json [--sections ceilings,decode,prefill,offline] [--quick]

1. Ceilings, measured in this run: device-to-device copy bandwidth (bytes read + written) and the bf16
   GEMM rate (8192^3, random data).
2. Decode step time for the llama-3.1-8b config (dummy weights, random KV) at batch 1/8/32/64/256 and
   1k/4k context vs its floor: (weight bytes + KV bytes read) / bandwidth; beside it the FP8 floor, the GEMM
   weights at one byte each (`floor_fp8_weights_ms`; bench/fp8_check.py times the FP8 engine against it).
3. Prefill tokens/s for one 1k/4k/16k prompt vs its FLOP floor (linear + causal attention) / GEMM rate.
4. Offline throughput: 256 requests, input and output lengths uniform in [100, 1024], for qwen3-0.6b and
   llama-3.1-8b, with and without CUDA graphs and overlap (the ablation).
5. decode_unfused: the decode steps again with the Triton kernels off (flashinfer + cuBLAS only): the in-run
   baseline of the Triton RoPE + K/V write, GEMVs and decode attention (decode_prologues: the GEMVs with the
   norms folded in; decode_cudacore: CUDA-core decode attention below batch 64).
Where time goes: kernel time by category (torch profiler) for decode b=1 and b=256 and prefill 4k.
Results are written to --out after each section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.runner import ModelRunner, RunnerConfig  # noqa: E402
from common.engine.sampling import argmax_rows  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402
from common.sched.request import Req  # noqa: E402
from common.sched.scheduler import Scheduler  # noqa: E402
from common.settings import SchedulerConfig  # noqa: E402

RESULTS: dict = {}
OUT: Path | None = None


def save() -> None:
    if OUT is not None:
        OUT.write_text(json.dumps(RESULTS, indent=2))


def log(msg: str) -> None:
    print(msg, flush=True)


def timed(fn, iters: int, warmup: int) -> list[float]:
    """Per-iteration device times (ms) from events between consecutive launches."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    evs[0].record()
    for i in range(iters):
        fn()
        evs[i + 1].record()
    evs[-1].synchronize()
    return [evs[i].elapsed_time(evs[i + 1]) for i in range(iters)]


def device_ms(fn, iters: int) -> float:
    """Median device time (ms) of one call, each timed on its own (events around it, synchronized), after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# ---- 1. ceilings ---------------------------------------------------------------------------------------
def ceilings(quick: bool) -> None:
    n = (1 << 30) if quick else (2 << 30)  # bytes per buffer
    src = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = statistics.median(timed(lambda: dst.copy_(src), 20, 3))
    bw = 2 * n / (t * 1e-3)
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    t_mm = statistics.mean(timed(lambda: x @ y, 10, 3))
    rate = 2 * m**3 / (t_mm * 1e-3)
    RESULTS["ceilings"] = dict(copy_bytes_per_s=bw, gemm_flop_per_s=rate, copy_buffer_bytes=n, gemm_n=m)
    log(f"ceilings: copy {bw / 1e12:.2f} TB/s (read+write), bf16 GEMM {rate / 1e12:.0f} TFLOP/s")
    save()


# ---- helpers over a runner -----------------------------------------------------------------------------
def experts_touched(runner: ModelRunner, tokens: int) -> float:
    """The fraction of a mixture-of-experts layer's experts that `tokens` tokens route to, each taking k of E
    distinct experts uniformly (what dummy weights' random router gives): 1 - (1 - k/E)^tokens (1 if dense)."""
    moe = runner.model_config.moe
    return 1.0 if moe is None else 1.0 - (1.0 - moe.top_k / moe.num_experts) ** tokens


def _expert_bytes(runner: ModelRunner) -> int:
    return sum(
        p.numel() * p.element_size()
        for layer in runner.model.layers
        if layer.moe is not None
        for p in (layer.moe.w13, layer.moe.w2)
    )


def weight_bytes(runner: ModelRunner, batch: int) -> int:
    """Bytes of weights one step reads: every matrix and norm (of a mixture of experts, only the experts the
    batch routes to: `experts_touched`), the embedding table only for `batch` rows (unless it is also the LM
    head)."""
    m = runner.model
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    experts = _expert_bytes(runner)
    total -= round(experts * (1.0 - experts_touched(runner, batch)))
    if m.lm_head is not None:
        total -= m.embed.numel() * m.embed.element_size()
        total += batch * m.cfg.hidden_size * m.embed.element_size()
    return total


def weight_bytes_fp8(runner: ModelRunner, batch: int) -> int:
    """`weight_bytes` with every layer's GEMM weights at one byte each (FP8), the rest as stored: the floor an
    FP8-weight model's decode step aims at (for an FP8 model the two are equal)."""
    dense = sum(
        p.numel() * p.element_size() for layer in runner.model.layers for p in layer.parameters() if p.dim() == 2
    )
    return weight_bytes(runner, batch) - dense + linear_params(runner)


def linear_params(runner: ModelRunner) -> int:
    """Matrix parameters every token multiplies through (all layers; of a mixture of experts its k routed
    experts and the router), excluding the LM head."""
    total = 0
    for layer in runner.model.layers:
        total += sum(p.numel() for p in layer.parameters() if p.dim() == 2)
        if layer.moe is not None:
            experts = layer.moe.w13.numel() + layer.moe.w2.numel()
            total += sum(p.numel() for p in (layer.moe.w13, layer.moe.w2))  # 3-D: not counted above
            total -= round(experts * (1.0 - layer.moe.config.top_k / layer.moe.w13.shape[0]))
    return total


def take_rows(runner: ModelRunner, lengths: list[int]) -> list[int]:
    """Table rows with consecutive fresh pages for sequences of the given lengths."""
    ps = runner.cfg.page_size
    rows, page = [], 0
    for n in lengths:
        k = -(-n // ps)
        assert page + k <= runner.pool.num_pages, "KV pool too small for this shape"
        row = runner.page_table.take_row()
        runner.page_table.write_pages(row, 0, torch.arange(page, page + k))
        page += k
        rows.append(row)
    return rows


def give_rows(runner: ModelRunner, rows: list[int]) -> None:
    for r in rows:
        runner.page_table.give_row(r)


def kernel_breakdown(fn, label: str) -> dict:
    """Device time per kernel category for one call of `fn`, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # First match wins: flashinfer's norm/rope/activation kernels before its attention, and attention
    # before GEMM (flashinfer's sm90 attention kernels carry cutlass in their names).
    cats = {
        "norm": ("norm",),
        "rope": ("rope", "rotary"),
        "silu_and_mul": ("act_and_mul", "silu"),
        "attention": ("prefill", "decode", "attention", "mergestate", "merge_state"),
        "kv_write": ("index_copy", "indexcopy"),
        "moe_experts": ("_experts_", "grouped_mm", "groupedmm"),
        "moe_route": ("_softmax_top_k", "softmax", "topk", "top_k"),
        "gemm": ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "sm90_"),
    }
    out: dict[str, float] = {k: 0.0 for k in cats}
    out["other"] = 0.0
    count = 0
    other_names: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name.lower()
        us = ev.time_range.elapsed_us()
        if "memcpy" in name or "memset" in name:
            key = "other"
        else:
            key = next((k for k, subs in cats.items() if any(s in name for s in subs)), "other")
        out[key] += us / 1000.0
        count += 1
        if key == "other":
            other_names[ev.name[:60]] = other_names.get(ev.name[:60], 0.0) + us / 1000.0
    out = {k: round(v, 4) for k, v in out.items()}
    out["kernels"] = count
    out["sum_ms"] = round(sum(v for k, v in out.items() if k not in ("kernels",)), 4)
    out["top_other"] = dict(sorted(other_names.items(), key=lambda kv: -kv[1])[:5])
    log(f"  breakdown {label}: {json.dumps({k: v for k, v in out.items() if k != 'top_other'})}")
    return out


# ---- 2. decode -----------------------------------------------------------------------------------------
@torch.inference_mode()
def decode_bench(
    runner: ModelRunner, quick: bool, batches=(1, 8, 32, 64, 256), key_name: str = "decode", breakdowns: bool = True
) -> None:
    bw = RESULTS["ceilings"]["copy_bytes_per_s"]
    rate = RESULTS["ceilings"]["gemm_flop_per_s"]
    mc = runner.model_config
    gemm_params = linear_params(runner) + mc.vocab_size * mc.hidden_size
    bpt = runner.layout.bytes_per_token
    cap = runner.pool.num_pages * runner.cfg.page_size
    for block in runner.pool.kv.split(4096):  # random KV: never time on zeros
        block.normal_()
    rows_out = []
    for ctx in (1024, 4096):
        for b in batches:
            key = f"b{b}_ctx{ctx}"
            if b * (ctx + runner.cfg.page_size) > cap:
                rows_out.append(dict(key=key, batch=b, ctx=ctx, skipped=f"KV of {b}x{ctx} tokens exceeds the pool"))
                RESULTS[key_name] = rows_out
                log(f"decode {key}: skipped (KV {b * ctx * bpt / 1e9:.0f} GB does not fit next to the weights)")
                continue
            rows = take_rows(runner, [ctx] * b)
            ids = torch.randint(0, runner.model_config.vocab_size, (b,)).tolist()
            fb = runner.build_batch([[t] for t in ids], [ctx - 1] * b, rows, [True] * b, True)

            def step(fb=fb):
                argmax_rows(runner.forward(fb))

            iters = 10 if quick else 30
            t_step = statistics.median(timed(step, iters, 3))
            graphs = runner.gpu.graphs
            t_replay = None
            if graphs is not None and b <= graphs.max_bs:
                g = graphs.graphs[graphs.pick(b)]
                runner.forward(fb)  # plans this batch into the graph's wrapper
                t_replay = statistics.median(timed(g.replay, iters, 3))
            wbytes = weight_bytes(runner, b)
            kvbytes = b * ctx * bpt
            floor = (wbytes + kvbytes) / bw * 1e3
            floor_fp8 = (weight_bytes_fp8(runner, b) + kvbytes) / bw * 1e3  # GEMM weights at one byte
            # Roofline per phase: the GEMMs take the larger of their bytes and their FLOPs (at b=256 the
            # FLOPs), attention its KV bytes.
            gemm_floor = max(wbytes / bw, 2 * b * gemm_params / rate) * 1e3
            floor_roofline = gemm_floor + kvbytes / bw * 1e3
            r = dict(
                key=key,
                batch=b,
                ctx=ctx,
                step_ms=t_step,
                replay_ms=t_replay,
                floor_ms=floor,
                floor_fp8_weights_ms=floor_fp8,
                weight_bytes=wbytes,
                kv_bytes=kvbytes,
                ratio=floor / t_step,
                floor_roofline_ms=floor_roofline,
                ratio_roofline=floor_roofline / t_step,
                tensor_core_decode=runner.gpu.attn.decode_tensor_cores(b),
                ratio_replay=floor / t_replay if t_replay else None,
                tok_per_s=b / (t_step * 1e-3),
            )
            if breakdowns and (b, ctx) in ((1, 1024), (256, 1024)):
                r["breakdown_graph"] = kernel_breakdown(step, f"decode {key} (graph replay)")
                runner.gpu.use_graphs = False
                r["eager_step_ms"] = statistics.median(timed(step, iters, 3))
                r["breakdown_eager"] = kernel_breakdown(step, f"decode {key} (eager)")
                runner.gpu.use_graphs = True
            rows_out.append(r)
            log(
                f"decode {key}: step {t_step:.3f} ms (replay {t_replay or float('nan'):.3f}), floor {floor:.3f} ms (FP8 weights {floor_fp8:.3f}), "
                f"ratio {r['ratio']:.2f} (replay {r['ratio_replay'] or float('nan'):.2f})"
            )
            give_rows(runner, rows)
            RESULTS[key_name] = rows_out
            save()


# ---- 3. prefill ----------------------------------------------------------------------------------------
@torch.inference_mode()
def prefill_bench(runner: ModelRunner, quick: bool) -> None:
    rate = RESULTS["ceilings"]["gemm_flop_per_s"]
    mc = runner.model_config
    lin = linear_params(runner)
    out = []
    for n in (1024, 4096, 16384):
        if n > runner.max_seq_len:
            continue
        rows = take_rows(runner, [n])
        ids = torch.randint(0, mc.vocab_size, (n,)).tolist()
        fb = runner.build_batch([ids], [0], rows, [True], False)
        iters = 3 if quick else 6
        t = statistics.median(timed(lambda fb=fb: runner.forward(fb), iters, 2))
        flops_lin = 2 * n * lin + 2 * mc.vocab_size * mc.hidden_size
        flops_attn = 4 * mc.num_heads * mc.head_dim * (n * (n + 1) // 2) * mc.num_layers
        floor = (flops_lin + flops_attn) / rate * 1e3
        r = dict(
            tokens=n,
            ms=t,
            tok_per_s=n / (t * 1e-3),
            flops_linear=flops_lin,
            flops_attention=flops_attn,
            floor_ms=floor,
            ratio=floor / t,
            achieved_flop_per_s=(flops_lin + flops_attn) / (t * 1e-3),
        )
        if n == 4096:
            r["breakdown"] = kernel_breakdown(lambda fb=fb: runner.forward(fb), "prefill 4k")
        out.append(r)
        log(
            f"prefill {n}: {t:.1f} ms, {r['tok_per_s']:.0f} tok/s, {r['achieved_flop_per_s'] / 1e12:.0f} TFLOP/s, "
            f"floor {floor:.1f} ms, ratio {r['ratio']:.2f}"
        )
        give_rows(runner, rows)
        RESULTS["prefill"] = out
        save()


# ---- 4. offline throughput -----------------------------------------------------------------------------
def workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    ins = torch.randint(100, 1025, (n,), generator=g).tolist()
    outs = torch.randint(100, 1025, (n,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (m,), generator=g).tolist() for m in ins]
    return prompts, outs


@torch.inference_mode()
def run_offline(runner: ModelRunner, prompts, outs, graphs: bool, overlap: bool, max_prefill: int) -> dict:
    runner.gpu.use_graphs = graphs
    cfg = SchedulerConfig(max_prefill_tokens=max_prefill)
    sched = Scheduler(runner, cfg, overlap=overlap)
    reqs = [
        Req(req_id=f"r{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=o, ignore_eos=True))
        for i, (p, o) in enumerate(zip(prompts, outs))
    ]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for r in reqs:
        sched.add(r)
    steps = 0
    peak_running = 0
    while sched.has_work():
        sched.step()
        steps += 1
        peak_running = max(peak_running, len(sched.running))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    runner.gpu.use_graphs = True
    assert all(r.finished and len(r.output_ids) == o for r, o in zip(reqs, outs))
    n_out = sum(outs)
    n_in = sum(len(p) for p in prompts)
    return dict(
        graphs=graphs,
        overlap=overlap,
        wall_s=wall,
        steps=steps,
        ms_per_step=wall / steps * 1e3,
        output_tok_per_s=n_out / wall,
        total_tok_per_s=(n_out + n_in) / wall,
        peak_running=peak_running,
    )


def offline_bench(runner: ModelRunner, name: str, quick: bool) -> None:
    n = 64 if quick else 256
    prompts, outs = workload(n, runner.model_config.vocab_size)
    warm_p, warm_o = workload(8, runner.model_config.vocab_size, seed=1)
    run_offline(runner, warm_p, [16] * 8, True, True, 8192)  # warm-up: lazy inits, allocator
    res = {"requests": n, "input_tokens": sum(len(p) for p in prompts), "output_tokens": sum(outs), "runs": []}
    for graphs, overlap in ((False, False), (True, False), (False, True), (True, True)):
        r = run_offline(runner, prompts, outs, graphs, overlap, 8192)
        res["runs"].append(r)
        log(
            f"offline {name} graphs={graphs} overlap={overlap}: {r['wall_s']:.1f} s, "
            f"{r['output_tok_per_s']:.0f} out tok/s, {r['total_tok_per_s']:.0f} total tok/s, "
            f"{r['steps']} steps ({r['ms_per_step']:.2f} ms/step), peak running {r['peak_running']}"
        )
        RESULTS.setdefault("offline", {})[name] = res
        save()
    base = res["runs"][0]["output_tok_per_s"]
    res["speedup_graphs_overlap_vs_baseline"] = res["runs"][-1]["output_tok_per_s"] / base
    save()


# ---- main ----------------------------------------------------------------------------------------------
def make_runner(
    model: str,
    kv_gb: float,
    max_seq_len: int,
    max_running: int = 256,
    label: str = "",
    tc_min_batch: int = 1,
    fused: bool = True,
    prologues: bool = False,
    gemv_experts: bool = True,
    mla_split_decode: bool = True,
) -> ModelRunner:
    start = time.perf_counter()
    runner = ModelRunner(
        RunnerConfig(
            model=f"dummy:{model}",
            device="cuda",
            kv_memory_gb=kv_gb,
            max_running=max_running,
            max_seq_len=max_seq_len,
            cuda_graph_max_bs=max_running,
            decode_tc_min_batch=tc_min_batch,
            fused_kernels=fused,
            gemv_prologues=prologues,
            gemv_experts=gemv_experts,
            mla_split_decode=mla_split_decode,
        )
    )
    graphs = runner.gpu.graphs
    label = label or model
    RESULTS.setdefault("setup", {})[label] = dict(
        seconds=time.perf_counter() - start,
        graph_capture_seconds=graphs.capture_seconds if graphs else None,
        graph_sizes=graphs.sizes if graphs else None,
        kv_pages=runner.pool.num_pages,
        tensor_core_decode=runner.gpu.attn.tensor_cores,
        tensor_core_min_batch=runner.gpu.attn.tc_min_batch,
        fused_kernels=runner.gpu.attn.rope_store is not None,
        gemv_max_rows=runner.model.ops.gemv_max_rows,
        gemv_prologues=runner.model.ops.fold_prologues,
        gemv_stream_stats=runner.model.ops.stream_stats,
        gemv_gated=runner.model.ops.gated_epilogue,
        gemv_rope=runner.model.ops.rope_epilogue,
        moe_gemv_max_tokens=runner.gpu.moe_gemv_max_tokens,
    )
    log(f"{label}: ready in {time.perf_counter() - start:.1f} s ({RESULTS['setup'][label]})")
    return runner


def summary() -> None:
    c = RESULTS.get("ceilings", {})
    lines = []
    if c:
        lines.append(
            f"ceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 GEMM {c['gemm_flop_per_s'] / 1e12:.0f} TFLOP/s"
        )
    for name in ("decode", "decode_unfused", "decode_prologues", "decode_cudacore"):
        for r in RESULTS.get(name, []):
            if "skipped" in r:
                lines.append(f"{name} {r['key']:>12}: skipped ({r['skipped']})")
            else:
                lines.append(
                    f"{name} {r['key']:>12}: {r['step_ms']:7.3f} ms  floor {r['floor_ms']:7.3f} ms  "
                    f"ratio {r['ratio']:.2f}  (roofline floor {r['floor_roofline_ms']:7.3f} ms, "
                    f"ratio {r['ratio_roofline']:.2f})"
                )
    for r in RESULTS.get("prefill", []):
        lines.append(
            f"prefill {r['tokens']:>6}: {r['ms']:7.1f} ms  {r['tok_per_s']:8.0f} tok/s  floor {r['floor_ms']:6.1f} ms  "
            f"ratio {r['ratio']:.2f}"
        )
    for name, res in RESULTS.get("offline", {}).items():
        for r in res["runs"]:
            lines.append(
                f"offline {name:>12} graphs={r['graphs']!s:5} overlap={r['overlap']!s:5}: "
                f"{r['output_tok_per_s']:8.0f} out tok/s  {r['total_tok_per_s']:8.0f} total tok/s  {r['wall_s']:6.1f} s"
            )
    print("\n".join(["", "== summary =="] + lines), flush=True)


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sections", default="ceilings,decode,prefill,offline,decode_unfused,decode_cudacore")
    ap.add_argument("--quick", action="store_true")
    # 60 GB of KV leaves an 80 GB card (the H100) too little beside the 8B's 16 GB of weights and its graphs
    ap.add_argument("--kv-gb", type=float, default=60.0, help="KV pool of each runner (GB)")
    args = ap.parse_args()
    OUT = args.out
    logging.basicConfig(level=logging.WARNING)
    sections = set(args.sections.split(","))
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    RESULTS["argv"] = sys.argv
    ceilings(args.quick)
    try:
        if sections & {"decode", "prefill", "offline"}:
            runner = make_runner("llama-3.1-8b", kv_gb=args.kv_gb, max_seq_len=16384 + 64)
            if "decode" in sections:
                decode_bench(runner, args.quick)
            if "prefill" in sections:
                prefill_bench(runner, args.quick)
            if "offline" in sections:
                offline_bench(runner, "llama-3.1-8b", args.quick)
            del runner
            gc.collect()
            torch.cuda.empty_cache()
        # The decode steps again on runners built another way, each the in-run comparison for one choice:
        # decode_unfused the Triton kernels off (flashinfer + cuBLAS only), decode_prologues the norms and SiLU-mul
        # folded into the GEMVs (fewer kernels; measured slower), decode_cudacore CUDA-core decode attention
        # below batch 64 (GQA 4 allows tensor cores).
        variants = {
            "decode_unfused": ("unfused", (1, 8, 32, 256), True, dict(fused=False)),
            "decode_prologues": ("prologues", (1, 8), True, dict(prologues=True)),
            "decode_cudacore": ("cudacore<64", (1, 8, 32), False, dict(tc_min_batch=64)),
        }
        for key_name, (label, batches, breakdowns, opts) in variants.items():
            if key_name not in sections:
                continue
            runner = make_runner(
                "llama-3.1-8b", kv_gb=args.kv_gb, max_seq_len=16384 + 64, label=f"llama-3.1-8b/{label}", **opts
            )
            decode_bench(runner, args.quick, batches=batches, key_name=key_name, breakdowns=breakdowns)
            del runner
            gc.collect()
            torch.cuda.empty_cache()
        if "offline" in sections:
            runner = make_runner("qwen3-0.6b", kv_gb=args.kv_gb, max_seq_len=2048 + 64)
            offline_bench(runner, "qwen3-0.6b", args.quick)
    finally:
        save()
        summary()


if __name__ == "__main__":
    main()
