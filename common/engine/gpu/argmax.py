"""Argmax over each row of a few wide rows (greedy sampling), in two launches: torch reduces a row in one thread
block, a visible share of a batch-1 step. One program per (row, chunk), then a pick per row; ties go to the lowest
id as in torch, and a NaN counts as +inf. Batches over `MAX_ROWS` keep torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096
MAX_CHUNKS = 256  # one program of the second launch reads them all: rows up to 1M ids
MAX_ROWS = 16


@triton.jit(do_not_specialize=["stride", "vocab", "chunks"])
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, stride, vocab, chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    ids = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride + ids, mask=ids < vocab, other=-float("inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best = tl.max(x, axis=0)
    first = tl.min(tl.where(x == best, ids, vocab), axis=0)
    tl.store(val_ptr + row * chunks + c, best)
    tl.store(idx_ptr + row * chunks + c, first)


@triton.jit(do_not_specialize=["chunks"])
def _pick_kernel(val_ptr, idx_ptr, out_ptr, chunks, CHUNKS_POW2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_POW2)
    ok = c < chunks
    v = tl.load(val_ptr + row * chunks + c, mask=ok, other=-float("inf"))
    i = tl.load(idx_ptr + row * chunks + c, mask=ok, other=2147483647)
    best = tl.max(v, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(v == best, i, 2147483647), axis=0).to(tl.int64))


def fits(x: torch.Tensor) -> bool:
    """Rows this argmax serves: 2-D, 1 to MAX_ROWS rows of unit stride, at most MAX_CHUNKS chunks."""
    return x.dim() == 2 and x.stride(1) == 1 and 0 < x.shape[1] <= MAX_CHUNKS * CHUNK and 0 < x.shape[0] <= MAX_ROWS


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    b, vocab = x.shape
    chunks = triton.cdiv(vocab, CHUNK)
    vals = torch.empty(b, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(b, chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    _chunk_max_kernel[(b, chunks)](x, vals, idx, x.stride(0), vocab, chunks, CHUNK=CHUNK, num_warps=8)
    _pick_kernel[(b,)](vals, idx, out, chunks, CHUNKS_POW2=max(16, triton.next_power_of_2(chunks)), num_warps=1)
    return out
