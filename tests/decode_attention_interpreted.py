"""Run by tests/test_decode_attention_interpreted.py under TRITON_INTERPRET=1 (Triton's interpreter, on the
CPU): the split-KV decode kernel over shuffled pages against float64 attention; prints one JSON line.

Queries are float32 here: the interpreter computes bfloat16 operands wrongly (the GPU tests in
tests/test_gpu_kernels.py cover bfloat16). Pages are float32 or e4m3 with per-layer scales."""

from __future__ import annotations

import json

import torch

from common.engine.gpu.decode_attention import TileConfig, decode_attention
from tests.paged_reference import attention_float64, csr_lengths


def cases() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ps, pages, hkv, hq, d = 16, 60, 2, 8, 32
    lens = [1, 17, 100, 300]
    out = []
    for dtype, ks, vs in [(torch.float32, 1.0, 1.0), (torch.float8_e4m3fn, 0.5, 0.25)]:
        kv = torch.randn(pages, 2, 2, ps, hkv, d, generator=g).to(dtype)
        k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]  # layer 1 of 2: strided views, as the pool gives them
        total, indptr, last = csr_lengths(lens, ps, "cpu")
        indices = torch.randperm(pages, generator=g)[:total].to(torch.int32)
        q = torch.randn(len(lens), hq, d, generator=g)
        refs = attention_float64(q, k_cache, v_cache, indptr, indices, lens, ks, vs)
        for splits, tile in [(1, TileConfig()), (3, TileConfig()), (1, TileConfig(pages_per_tile=8))]:
            got = decode_attention(q, k_cache, v_cache, indptr, indices, last, splits, ks, vs, tile)
            worst = max(float((got[i].double() - ref).norm() / ref.norm()) for i, ref in enumerate(refs))
            out.append({"pages": str(dtype), "splits": splits, "ppt": tile.pages_per_tile, "rel_err": worst})
    return out


if __name__ == "__main__":
    print(json.dumps({"cases": cases()}))
