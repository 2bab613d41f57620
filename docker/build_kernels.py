"""Compiles, without a GPU, every flashinfer kernel module the engine's GPU path loads (common/engine/gpu/), for the
architectures in FLASHINFER_CUDA_ARCH_LIST (the CUDA image: "9.0a 10.0a"), and installs each where flashinfer
looks for prebuilt modules first (its package's data/aot/<module>/<module>.so): a worker then loads them at start
instead of compiling them. A module the list misses (another head size, a model family it does not name) is
still compiled at its first use, as before (the image keeps nvcc for that).

The modules, per head size (--head-dims) and 16-bit dtype (--dtypes), each as the engine asks flashinfer for it:
    prefill, FA2         16-bit pages and e4m3 pages (FP8 KV), with the paged module for independent K/V strides
                         (the prefill wrapper, and decode steps on tensor cores)
    prefill, FA3 (sm90)  16-bit pages, and e4m3 queries over e4m3 pages (the FP8 prefill path)
    decode, FA2          16-bit pages and e4m3 pages (decode steps on CUDA cores)
    XQA (sm90)           e4m3 pages of --page-size tokens, per query heads per KV head (--group-ratios)
    norm, SiLU-and-mul, rope
and per latent-attention shape (--mla: DeepSeek-V2/V3's kv_lora_rank 512, RoPE part 64, decompressed heads of
192 query/key and 128 value dims; common/engine/gpu/mla_attention.py):
    MLA paged, FA3 (sm90) or FA2 (others)   absorbed decode and prefill over the latent pages, 16-bit
    ragged prefill, FA3 (sm90) or FA2       the decompressed prefill (KVFERRY_MLA_DECOMPRESSED_PREFILL)
Their names are flashinfer's own (its generators take the same arguments its wrappers pass), so a flashinfer
version whose arguments differ fails here, at build time, not at a pod's start.

    FLASHINFER_CUDA_ARCH_LIST="9.0a 10.0a" python docker/build_kernels.py [--head-dims 64,128] [--list]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def kernel_specs(
    dtype_names: list[str],
    head_dims: list[int],
    group_ratios: list[int],
    page_size: int,
    mla_shapes: list[tuple[int, int, int, int]] = [],  # noqa: B006 (read only)
) -> Iterator:
    """flashinfer's JitSpec of every module the engine loads for these shapes (module docstring); `mla_shapes`:
    (latent rank, RoPE dims, decompressed query/key dims, value dims) per latent-attention model."""
    import torch
    from flashinfer.compilation_context import CompilationContext
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention import gen_batch_decode_module, gen_batch_mla_module, gen_batch_prefill_module
    from flashinfer.jit.attention.modules import (
        _gen_batch_prefill_independent_paged_module,
        _gen_batch_prefill_primary_module,
    )
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module
    from flashinfer.jit.xqa import gen_xqa_module

    hopper = any(major == 9 for major, _ in CompilationContext().TARGET_CUDA_ARCHS)
    e4m3 = torch.float8_e4m3fn
    idx = torch.int32
    yield gen_norm_module()
    yield gen_act_and_mul_module("silu")
    yield gen_rope_module()
    for name in dtype_names:
        dt = getattr(torch, DTYPES[name])
        for d in head_dims:
            # (pos encoding none, no sliding window, no soft cap, no fp16 QK reduction, no token-head scales):
            # what common/engine/gpu/attention.py plans with
            for kv in (dt, e4m3):
                args = (dt, kv, dt, idx, d, d, 0, False, False, False, False)
                yield _gen_batch_prefill_primary_module("fa2", *args)
                yield _gen_batch_prefill_independent_paged_module("fa2", *args)
                yield gen_batch_decode_module(dt, kv, dt, idx, d, d, 0, False, False)
            if not hopper:
                continue
            yield gen_batch_prefill_module("fa3", dt, dt, dt, idx, d, d, 0, False, False, False)
            if d != 64:  # flashinfer's FA3 has no e4m3 kernel for head size 64
                yield gen_batch_prefill_module("fa3", e4m3, e4m3, dt, idx, d, d, 0, False, False, False)
            for ratio in group_ratios:
                yield gen_xqa_module(dt, e4m3, page_size, d, ratio, False, dt)
        # The MLA wrapper's backend is the engine's (mla_attention.mla_backend_name); the ragged prefill's is
        # flashinfer's own choice, FA3 for 192/128 on Hopper: one image serves both architectures, so both builds.
        for rank, rope, qk, vo in mla_shapes:
            for backend in ("fa2", "fa3") if hopper else ("fa2",):
                yield gen_batch_mla_module(backend, dt, dt, dt, idx, rank, rope, False)
            args = (dt, dt, dt, idx, qk, vo, 0, False, False, False, False)
            yield _gen_batch_prefill_primary_module("fa2", *args)
            yield _gen_batch_prefill_independent_paged_module("fa2", *args)
            if hopper:
                yield gen_batch_prefill_module("fa3", *args[:-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bf16", help="16-bit model dtypes: bf16, fp16 (comma-separated)")
    ap.add_argument("--head-dims", default="64,128", help="attention head sizes (Llama/Qwen 128, SmolLM2 64)")
    ap.add_argument("--group-ratios", default="1,2,4,8", help="query heads per KV head (XQA builds one per ratio)")
    ap.add_argument("--page-size", type=int, default=16, help="KV page size (KVFERRY_PAGE_SIZE)")
    ap.add_argument(
        "--mla",
        default="512:64:192:128",
        help="latent-attention shapes rank:rope:qk:vo, comma-separated (DeepSeek-V2/V3; empty: none)",
    )
    ap.add_argument("--list", action="store_true", help="print the modules' names only")
    args = ap.parse_args()
    if "FLASHINFER_CUDA_ARCH_LIST" not in os.environ:
        print('set FLASHINFER_CUDA_ARCH_LIST (the image: "9.0a 10.0a"): without a GPU nothing names the target')
        return 2
    import flashinfer.jit as fjit
    from flashinfer.jit import env as jit_env

    specs = list(
        kernel_specs(
            args.dtypes.split(","),
            [int(d) for d in args.head_dims.split(",")],
            [int(r) for r in args.group_ratios.split(",")],
            args.page_size,
            [tuple(int(x) for x in shape.split(":")) for shape in args.mla.split(",") if shape],  # type: ignore[misc]
        )
    )
    if args.list:
        print("\n".join(s.name for s in specs))
        return 0
    started = time.perf_counter()
    print(f"compiling {len(specs)} modules for {os.environ['FLASHINFER_CUDA_ARCH_LIST']}", flush=True)
    fjit.build_jit_specs(specs, verbose=False, skip_prebuilt=False)
    out = Path(jit_env.FLASHINFER_AOT_DIR)
    for spec in specs:
        dst = out / spec.name / f"{spec.name}.so"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, dst)
    print(f"{len(specs)} modules in {out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
