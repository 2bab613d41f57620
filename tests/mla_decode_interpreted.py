"""Run by tests/test_mla_decode_interpreted.py under TRITON_INTERPRET=1 (Triton's interpreter, on the CPU): the
split-KV latent-attention decode kernel (common/engine/gpu/mla_decode.py) and its merge over shuffled pages of a
latent pool against float64 absorbed attention; prints one JSON line.

float32 here: the interpreter computes bfloat16 operands wrongly (tests/test_gpu_kernels.py runs bfloat16 on the
GPU). The real widths (kv_lora_rank 512, RoPE 64); few heads and pages keep the interpreter's time small."""

from __future__ import annotations

import json

import torch

from common.engine.gpu.mla_decode import mla_decode
from tests.paged_reference import csr_lengths, mla_attention_float64

RANK, ROPE, PAGE, PAGES, LAYERS = 512, 64, 16, 48, 2

# (heads, lengths): partial last pages (not 16 / 64), one-token requests, requests spread over every split and ones
# shorter than one (five splits of 10 and 13 pages; two-page tiles), and a second block of heads.
SHAPES = [
    (4, [150]),
    (4, [1, 16, 53]),
    (4, [5, 17, 33, 64, 2, 200, 16, 49]),
    (18, [40]),
]
SPLITS = (1, 2, 5)


def cases() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    # The pool's layout, [pages, layers, 1, page_size, 1, rank + rope]: the kernel reads strided views of layer 1.
    kv = torch.randn(PAGES, LAYERS, 1, PAGE, 1, RANK + ROPE, generator=g)
    ckv, kpe = kv[:, 1, 0, :, 0, :RANK], kv[:, 1, 0, :, 0, RANK:]
    scale = (128 + ROPE) ** -0.5
    out = []
    for heads, lens in SHAPES:
        b = len(lens)
        total, indptr, _ = csr_lengths(lens, PAGE, "cpu")
        indices = torch.randperm(PAGES, generator=g)[:total].to(torch.int32)
        kv_lens = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(b, heads, RANK + ROPE, generator=g)  # the packed absorbed query, split by views
        refs = mla_attention_float64(q[..., :RANK], q[..., RANK:], ckv, kpe, indptr, indices, lens, scale)
        for splits in SPLITS:
            # The layer's head-major output buffer (W_UV's batched GEMM reads it), poisoned.
            dst = torch.full((heads, b, RANK), float("nan")).transpose(0, 1)
            got = mla_decode(q[..., :RANK], q[..., RANK:], ckv, kpe, indptr, indices, kv_lens, splits, scale, dst)
            worst = max(float((got[i].double() - ref).norm() / ref.norm()) for i, ref in enumerate(refs))
            out.append(
                {
                    "heads": heads,
                    "batch": b,
                    "splits": splits,
                    "rel_err": worst,
                    "finite": bool(torch.isfinite(dst).all()),
                    "into_out": got.data_ptr() == dst.data_ptr(),
                }
            )
    return out


if __name__ == "__main__":
    print(json.dumps({"cases": cases()}))
