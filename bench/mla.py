"""DeepSeek-V2-Lite (latent attention, 64 experts) on the GPU path (run on the GPU machine; dummy weights).

    python bench/mla.py --out OUT.json [--quick] [--dense] [--small-kernel on|off] [--sweep]

In one run: the device's copy bandwidth and GEMM rate (the ceilings, bench/roofline.py), then for DeepSeek-V2-Lite
(flashinfer's MLA kernels, absorbed, except eager prompt chunks with no cached prefix, decompressed: the latents
expanded through kv_b_proj, then flashinfer's ragged prefill at head dims 192 / 128; decode and piecewise step
graphs):
1. decode steps at batch 1/16/64/256 and 1k/4k context against their floor (weight bytes the batch reads, its routed
   experts only, plus the latent KV bytes) / bandwidth;
2. prefill of 1k and 4k prompts against the FLOP floor (decompressed, the path's default); then the same two whole
   prefill steps in both forms, alternately in this run: ratio absorbed / decompressed (`prefill_forms`);
3. MLA attention per layer: flashinfer's kernel alone and the layer's whole latent attention (RoPE, the entry
   write, W_UK folded into the query, the kernel, W_UV), for the same decode shapes (ratio: the latent KV bytes at
   the copy bandwidth over the kernel's time) and one 4k prompt, causal (ratio: its FLOPs at the GEMM rate over the
   kernel's time); beside the 4k prompt, the decompressed form (the expansion with the ragged kernel, and the whole
   layer), which does about a third of the absorbed form's attention FLOPs;
   With `--small-kernel on` (the default) each decode shape (batch 1/4/16/64/256) also runs the split-KV Triton
   kernel (common/engine/gpu/mla_decode.py; the path takes it up to `SPLIT_DECODE_MAX_BS` requests), every shape,
   so the crossover shows: both kernels eager and captured in a CUDA graph (the decode graphs' form: no host time),
   the ratio flashinfer / Triton, and the Triton output's error against flashinfer's;
4. the latent KV bytes per token against Llama-3.1-8B's.
`--dense` adds Llama-3.1-8B's decode and prefill (bench/roofline.py's sections) for throughput side by side.
`--small-kernel off` builds the runner without the split-KV kernel: every step (section 1 too) on flashinfer's.
`--sweep` adds the split-KV kernel alone over tile shapes and split counts at batch 1/4/16 (compiles ~40 variants).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import roofline  # noqa: E402

from common.engine.gpu.attention import PageMeta  # noqa: E402
from common.engine.gpu.mla_attention import SPLIT_DECODE_MAX_BS, FlashInferMlaAttention  # noqa: E402
from common.engine.kv_sizing import model_kv_layout  # noqa: E402
from common.engine.mla import MlaParts  # noqa: E402
from common.engine.named_configs import named_config  # noqa: E402

MODEL = "deepseek-v2-lite"
DENSE = "llama-3.1-8b"
BATCHES = (1, 16, 64, 256)
ATTENTION_BATCHES = (1, 4, 16, 64, 256)
GRAPH_REPS = 20  # attention calls per captured graph: one replay's time over these, each call's


def _section(name: str, quick: bool, split_decode: bool = True) -> roofline.ModelRunner:
    runner = roofline.make_runner(name, kv_gb=40.0, max_seq_len=4096 + 64, mla_split_decode=split_decode)
    roofline.decode_bench(runner, quick=quick, batches=BATCHES, key_name=f"decode/{name}", breakdowns=False)
    roofline.prefill_bench(runner, quick=quick)
    roofline.RESULTS[f"prefill/{name}"] = roofline.RESULTS.pop("prefill")
    return runner


def _decompressed_prefill_ms(runner: roofline.ModelRunner, fb, x: dict, iters: int) -> tuple[float, float]:
    """A no-prefix prompt's attention in the path's decompressed form (`FlashInferMlaAttention.attend_decompressed`:
    every latent through kv_b_proj, then flashinfer's ragged causal prefill with qk head dim nope + rope and value
    head dim v), and the whole layer in that form (RoPE, the entry write, then the same): ms each."""
    attn = runner.gpu.attn
    proj = runner.model.layers[0].mla
    saved = attn.decompressed_prefill
    attn.decompressed_prefill = True
    try:
        attn.plan(fb)
    finally:
        attn.decompressed_prefill = saved
    assert attn.decompressed_from == 0, "a prompt with no cached prefix plans decompressed"
    parts = MlaParts(x["q_nope"], x["q_pe"], x["latent"], x["k_pe"])
    kernel = roofline.device_ms(lambda: attn.attend_decompressed(*parts, proj), iters)
    layer = roofline.device_ms(lambda: attn.forward_mla(0, fb.positions, parts, proj), iters)
    return kernel, layer


@torch.inference_mode()
def prefill_forms(runner: roofline.ModelRunner, quick: bool) -> list[dict]:
    """The model's whole prefill step of one fresh 1k and 4k prompt (eager: past the step graphs' tokens), its
    attention decompressed and absorbed in turn, in this run: ratio absorbed / decompressed."""
    attn = runner.gpu.attn
    iters = 3 if quick else 6
    out = []
    saved = attn.decompressed_prefill
    try:
        for n in (1024, 4096):
            if n > runner.max_seq_len:
                continue
            rows = roofline.take_rows(runner, [n])
            ids = torch.randint(0, runner.model_config.vocab_size, (n,)).tolist()
            fb = runner.build_batch([ids], [0], rows, [True], False)
            times: dict[str, list[float]] = {"decompressed": [], "absorbed": []}
            for form, on in 2 * (("decompressed", True), ("absorbed", False)):  # alternated: clock drift evens out
                attn.decompressed_prefill = on
                times[form] += roofline.timed(lambda fb=fb: runner.forward(fb), iters, 2)
                assert attn.decompressed_from == (0 if on else None), f"the {form} step planned otherwise"
            roofline.give_rows(runner, rows)
            ms = {form: statistics.median(t) for form, t in times.items()}
            row = dict(
                tokens=n,
                decompressed_ms=ms["decompressed"],
                absorbed_ms=ms["absorbed"],
                absorbed_over_decompressed=ms["absorbed"] / ms["decompressed"],
                decompressed_tok_per_s=n / (ms["decompressed"] * 1e-3),
            )
            out.append(row)
            roofline.log(
                f"prefill {n} whole step: decompressed {row['decompressed_ms']:.2f} ms, absorbed "
                f"{row['absorbed_ms']:.2f} ms, absorbed/decompressed {row['absorbed_over_decompressed']:.3f}"
            )
    finally:
        attn.decompressed_prefill = saved
    roofline.RESULTS["prefill_forms"] = out
    roofline.save()
    return out


def _graph_us(attn: FlashInferMlaAttention, meta: PageMeta, q: torch.Tensor, split_max_bs: int, iters: int) -> float:
    """One layer's decode attention as a decode graph runs it (over fixed CSR buffers, launches captured), on the
    split-KV kernel up to `split_max_bs` requests, else flashinfer's: microseconds per call."""
    b = int(meta.last_page_len.shape[0])
    dev = q.device
    buffers = (
        torch.zeros(b + 1, dtype=torch.int32, device=dev),
        torch.zeros(meta.indices.numel(), dtype=torch.int32, device=dev),
        torch.ones(b, dtype=torch.int32, device=dev),
    )
    saved = attn.split_decode_max_bs
    attn.split_decode_max_bs = split_max_bs
    try:
        wrapper = attn.make_decode_wrapper(buffers)
        attn.plan_decode(wrapper, meta)
        attn.bind(wrapper, torch.zeros(b, dtype=torch.int64, device=dev), buffers)
        return _graph_call_us(lambda: attn.attend(0, q), iters)
    finally:
        attn.split_decode_max_bs = saved


def _graph_call_us(fn, iters: int) -> float:
    """Microseconds per call of `fn` captured GRAPH_REPS times in one CUDA graph (no host time between calls)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles and lazy set-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(GRAPH_REPS):
            fn()
    return roofline.device_ms(graph.replay, iters) / GRAPH_REPS * 1e3


def _split_tile_sweep(runner: roofline.ModelRunner, iters: int) -> list[dict]:
    """The split-KV kernel alone (graph-captured) over tile shapes and split counts at a few small-batch shapes:
    what `mla_decode.TILE_TOKENS`, `default_tile` and the split rule would move to."""
    from common.engine.gpu.decode_attention import TileConfig
    from common.engine.gpu.mla_decode import mla_decode, splits_for

    attn = runner.gpu.attn
    mc = runner.model_config
    h, r, rope, ps = mc.num_heads, mc.mla.kv_lora_rank, mc.mla.qk_rope_head_dim, runner.cfg.page_size
    dev, dt = runner.device, runner.dtype
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tiles = [
        TileConfig(pages_per_tile=max(1, tokens // ps), num_warps=warps, num_stages=stages)
        for tokens, warps, stages in (
            (16, 4, 2),
            (32, 4, 2),
            (32, 8, 2),
            (64, 4, 2),
            (64, 8, 3),
        )
    ]
    out = []
    for b, ctx in ((1, 1024), (1, 4096), (4, 1024), (16, 1024), (16, 4096)):
        rows = roofline.take_rows(runner, [ctx] * b)
        fb = runner.build_batch([[0]] * b, [ctx - 1] * b, rows, [True] * b, True)
        meta = attn.step_meta(fb)
        pages = meta.indptr[1:] - meta.indptr[:-1]
        lens = ((pages - 1) * ps + meta.last_page_len).to(dev)
        indptr, indices = meta.indptr.to(dev), meta.indices.to(dev)
        q_nope = torch.randn(b, h, r, device=dev, dtype=dt)
        q_pe = torch.randn(b, h, rope, device=dev, dtype=dt)
        base = splits_for(b, h, sms)
        for splits in sorted({max(1, base // 2), base, 2 * base, 4 * base}):
            for tile in tiles:
                args = (q_nope, q_pe, attn.ckv[0], attn.kpe[0], indptr, indices, lens, splits, attn.scale, None, tile)
                us = _graph_call_us(functools.partial(mla_decode, *args, attn.pdl), iters)
                out.append(
                    dict(
                        batch=b,
                        ctx=ctx,
                        splits=splits,
                        path_splits=splits == base,
                        tile_tokens=tile.pages_per_tile * ps,
                        num_warps=tile.num_warps,
                        num_stages=tile.num_stages,
                        us=us,
                    )
                )
        roofline.give_rows(runner, rows)
        best = min((x for x in out if x["batch"] == b and x["ctx"] == ctx), key=lambda x: x["us"])
        roofline.log(f"  split-kv sweep b={b} ctx={ctx}: best {best}")
    return out


def _split_vs_flashinfer(runner: roofline.ModelRunner, fb, x: dict, row: dict, iters: int) -> None:
    """The split-KV kernel beside flashinfer's at one decode shape (eager and graph-captured), into `row`."""
    attn = runner.gpu.attn
    proj = runner.model.layers[0].mla
    b = row["batch"]
    saved = attn.split_decode_max_bs
    attn.split_decode_max_bs = b  # the split-KV kernel at this batch, whatever the path's threshold
    try:
        attn.plan(fb)
        split_out = attn.attend(0, x["q"]).float()
        kernel = roofline.device_ms(lambda: attn.attend(0, x["q"]), iters)
        parts = MlaParts(x["q_nope"], x["q_pe"], x["latent"], x["k_pe"])
        layer = roofline.device_ms(lambda: attn.forward_mla(0, fb.positions, parts, proj), iters)
        attn.split_decode_max_bs = 0
        attn.plan(fb)
        ref = attn.attend(0, x["q"]).float()
    finally:
        attn.split_decode_max_bs = saved
    meta = attn.step_meta(fb)
    graph_fi = _graph_us(attn, meta, x["q"], 0, iters)
    graph_split = _graph_us(attn, meta, x["q"], b, iters)
    row.update(
        split_kernel_us=kernel * 1e3,
        split_layer_us=layer * 1e3,
        graph_flashinfer_us=graph_fi,
        graph_split_us=graph_split,
        flashinfer_over_split_graph=graph_fi / graph_split,
        flashinfer_over_split_eager=row["kernel_us"] / (kernel * 1e3),
        split_ratio=row["floor_us"] / graph_split,
        split_rel_err=float((split_out - ref).norm() / ref.norm()),
        path_takes_split=b <= SPLIT_DECODE_MAX_BS,
    )
    roofline.log(
        f"  split-kv b={b}: kernel {row['split_kernel_us']:.1f} us eager / {graph_split:.1f} us graph "
        f"(flashinfer {row['kernel_us']:.1f} / {graph_fi:.1f}): flashinfer/split {row['flashinfer_over_split_graph']:.2f} "
        f"graph, {row['flashinfer_over_split_eager']:.2f} eager; layer {row['split_layer_us']:.1f} us; "
        f"floor/split {row['split_ratio']:.2f}; rel err vs flashinfer {row['split_rel_err']:.1e}"
    )


@torch.inference_mode()
def attention_bench(runner: roofline.ModelRunner, quick: bool, sweep: bool = False) -> None:
    bw = roofline.RESULTS["ceilings"]["copy_bytes_per_s"]
    rate = roofline.RESULTS["ceilings"]["gemm_flop_per_s"]
    mc = runner.model_config
    mla = mc.mla
    h, r, rope = mc.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim
    attn = runner.gpu.attn
    proj = runner.model.layers[0].mla
    dev, dt = runner.device, runner.dtype
    cap = runner.pool.num_pages * runner.cfg.page_size
    iters = 10 if quick else 30
    out = []

    def shapes(b: int, q_len: int):
        t = b * q_len
        return dict(
            q=torch.randn(t, h, r + rope, device=dev, dtype=dt),
            q_nope=torch.randn(t, h, mla.qk_nope_head_dim, device=dev, dtype=dt),
            q_pe=torch.randn(t, h, rope, device=dev, dtype=dt),
            latent=torch.randn(t, r, device=dev, dtype=dt),
            k_pe=torch.randn(t, rope, device=dev, dtype=dt),
        )

    split = attn.split_decode_max_bs > 0

    def measure(fb, x) -> tuple[float, float]:
        """flashinfer's MLA kernel alone and the whole layer on it (eager, absorbed)."""
        saved = attn.split_decode_max_bs, attn.decompressed_prefill
        attn.split_decode_max_bs, attn.decompressed_prefill = 0, False
        attn.plan(fb)
        attn.split_decode_max_bs, attn.decompressed_prefill = saved
        kernel = roofline.device_ms(lambda: attn.attend(0, x["q"]), iters)
        parts = MlaParts(x["q_nope"], x["q_pe"], x["latent"], x["k_pe"])
        layer = roofline.device_ms(lambda: attn.forward_mla(0, fb.positions, parts, proj), iters)
        return kernel, layer

    bpe = (r + rope) * torch.empty((), dtype=dt).element_size()  # bytes of one latent entry
    for ctx in (1024, 4096):
        for b in ATTENTION_BATCHES:
            if b * (ctx + runner.cfg.page_size) > cap:
                out.append(dict(batch=b, ctx=ctx, skipped="KV exceeds the pool"))
                continue
            rows = roofline.take_rows(runner, [ctx] * b)
            fb = runner.build_batch([[0]] * b, [ctx - 1] * b, rows, [True] * b, True)
            x = shapes(b, 1)
            kernel, layer = measure(fb, x)
            kv_bytes = b * ctx * bpe
            floor = kv_bytes / bw * 1e3
            row = dict(
                kind="decode",
                batch=b,
                ctx=ctx,
                kernel_us=kernel * 1e3,
                layer_us=layer * 1e3,
                kv_bytes=kv_bytes,
                floor_us=floor * 1e3,
                ratio=floor / kernel,
                kv_read_bytes_per_s=kv_bytes / (kernel * 1e-3),
            )
            out.append(row)
            roofline.log(
                f"mla attention decode b={b} ctx={ctx}: kernel {row['kernel_us']:.1f} us, layer {row['layer_us']:.1f} us, "
                f"floor {row['floor_us']:.1f} us, ratio {row['ratio']:.2f}"
            )
            if split:
                _split_vs_flashinfer(runner, fb, x, row, iters)
            roofline.give_rows(runner, rows)
    n = 4096
    rows = roofline.take_rows(runner, [n])
    fb = runner.build_batch([[0] * n], [0], rows, [True], False)
    x = shapes(1, n)
    kernel, layer = measure(fb, x)
    pairs = n * (n + 1) // 2
    flops = 2 * pairs * h * ((r + rope) + r)  # QK^T over the latent entry, PV over its latent part
    flops_decompressed = 2 * pairs * h * (mla.qk_head_dim + mla.v_head_dim) + 2 * n * r * h * (
        mla.qk_nope_head_dim + mla.v_head_dim
    )
    try:
        decompressed, decompressed_layer = _decompressed_prefill_ms(runner, fb, x, iters)
    except Exception as exc:  # a kernel that does not build here: the absorbed numbers stand alone
        roofline.log(f"decompressed prefill unavailable: {str(exc)[:300]}")
        decompressed = decompressed_layer = None
    roofline.give_rows(runner, rows)
    row = dict(
        kind="prefill",
        tokens=n,
        kernel_ms=kernel,
        layer_ms=layer,
        flops=flops,
        floor_ms=flops / rate * 1e3,
        ratio=flops / rate * 1e3 / kernel,
        decompressed_ms=decompressed,
        decompressed_layer_ms=decompressed_layer,
        flops_decompressed=flops_decompressed,
        absorbed_over_decompressed=kernel / decompressed if decompressed else None,
        absorbed_over_decompressed_layer=layer / decompressed_layer if decompressed_layer else None,
    )
    out.append(row)
    roofline.log(
        f"mla attention prefill {n}: kernel {kernel:.2f} ms, layer {layer:.2f} ms, floor {row['floor_ms']:.2f} ms, "
        f"ratio {row['ratio']:.2f}; decompressed {decompressed or float('nan'):.2f} ms, "
        f"layer {decompressed_layer or float('nan'):.2f} ms"
    )
    roofline.RESULTS["mla_attention_per_layer"] = out
    if split and sweep:
        roofline.RESULTS["split_decode_tile_sweep"] = _split_tile_sweep(runner, iters)
    roofline.save()


def kv_bytes() -> dict:
    mine = model_kv_layout(named_config(MODEL), 16, torch.bfloat16).bytes_per_token
    dense = model_kv_layout(named_config(DENSE), 16, torch.bfloat16).bytes_per_token
    out = dict(latent_bytes_per_token=mine, dense_bytes_per_token=dense, dense_over_latent=dense / mine)
    out["prompt_4k_bytes"] = dict(latent=4096 * mine, dense=4096 * dense)
    roofline.RESULTS["kv_bytes"] = out
    return out


def compare(dense: bool) -> dict:
    r = roofline.RESULTS
    out: dict = {}
    for a in r.get(f"decode/{MODEL}", []):
        if "skipped" in a:
            continue
        out[f"decode_b{a['batch']}_ctx{a['ctx']}"] = dict(
            step_ms=a["step_ms"], tok_per_s=a["tok_per_s"], ratio=a["ratio"]
        )
    for a in r.get(f"prefill/{MODEL}", []):
        out[f"prefill_{a['tokens']}"] = dict(ms=a["ms"], tok_per_s=a["tok_per_s"], ratio=a["ratio"])
    for a in r.get("prefill_forms", []):
        out.setdefault(f"prefill_{a['tokens']}", {}).update(
            absorbed_ms=a["absorbed_ms"], absorbed_over_decompressed=a["absorbed_over_decompressed"]
        )
    if dense:
        d = {(x["batch"], x["ctx"]): x for x in r.get(f"decode/{DENSE}", []) if "skipped" not in x}
        for key, v in out.items():
            if key.startswith("decode_"):
                b, ctx = (int(s) for s in key.removeprefix("decode_b").split("_ctx"))
                if (b, ctx) in d:
                    v["over_dense_tok_per_s"] = v["tok_per_s"] / d[(b, ctx)]["tok_per_s"]
        p = {x["tokens"]: x for x in r.get(f"prefill/{DENSE}", [])}
        for key, v in out.items():
            if key.startswith("prefill_") and int(key.removeprefix("prefill_")) in p:
                v["over_dense_tok_per_s"] = v["tok_per_s"] / p[int(key.removeprefix("prefill_"))]["tok_per_s"]
    r["compare"] = out
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dense", action="store_true", help=f"also {DENSE}'s decode and prefill, side by side")
    ap.add_argument(
        "--small-kernel",
        choices=("on", "off"),
        default="on",
        help="the split-KV Triton decode kernel at small batches (on: also timed beside flashinfer's per shape)",
    )
    ap.add_argument(
        "--sweep", action="store_true", help="with the split-KV kernel on: its tile shapes and split counts alone"
    )
    args = ap.parse_args()
    roofline.OUT = args.out
    logging.basicConfig(level=logging.WARNING)
    roofline.RESULTS.update(
        device=torch.cuda.get_device_name(), torch=torch.__version__, argv=sys.argv, small_kernel=args.small_kernel
    )
    print("kv bytes: " + json.dumps(kv_bytes()), flush=True)
    roofline.ceilings(args.quick)
    try:
        runner = _section(MODEL, args.quick, args.small_kernel == "on")
        roofline.RESULTS["mla_backend"] = runner.gpu.attn.backend
        roofline.RESULTS["split_decode_max_bs"] = runner.gpu.attn.split_decode_max_bs
        prefill_forms(runner, args.quick)
        attention_bench(runner, args.quick, args.sweep)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
        if args.dense:
            runner = _section(DENSE, args.quick)
            del runner
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        out = compare(args.dense)
        roofline.save()
        print("\n== deepseek-v2-lite ==\n" + json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    main()
