"""Split-KV paged decode attention for small batches (Triton), over flashinfer's page metadata: flashinfer's
planner splits KV into chunks of at least 128 tokens, too few programs at batch 1. One program per (request, KV
head, split), the split count fixed per batch size (graphs capture the grid) to fill the chip, then a
log-sum-exp merge (skipped with one split). FP8 pages are widened in registers, their scales folded as
flashinfer folds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.engine.gpu import pdl

GROUP_PAD = 16  # query rows per program: the GQA group padded to the MMA's narrow side
PAGES_PER_TILE = 4  # pages gathered per iteration


@triton.jit
def _decode_attention_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    indptr_ptr,
    indices_ptr,
    last_ptr,
    o_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
    stride_page,
    stride_tok,
    qk_scale,
    v_scale,
    out_ptr,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    HQ: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    GPAD: tl.constexpr,
    PPT: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    p0 = tl.load(indptr_ptr + b)
    n_pages = tl.load(indptr_ptr + b + 1) - p0
    seq_len = (n_pages - 1) * PAGE + tl.load(last_ptr + b)
    per_split = tl.cdiv(n_pages, NUM_SPLITS)
    lo = s * per_split
    hi = tl.minimum(lo + per_split, n_pages)

    g = tl.arange(0, GPAD)
    d = tl.arange(0, D)
    g_ok = g < GROUP
    q = tl.load(
        q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0
    )

    m = tl.full([GPAD], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([GPAD], dtype=tl.float32)
    acc = tl.zeros([GPAD, D], dtype=tl.float32)
    t = tl.arange(0, PPT * PAGE)
    head_off = h * D
    for first in range(lo, hi, PPT):
        page_idx = first + t // PAGE
        page_ok = page_idx < hi
        page = tl.load(indices_ptr + p0 + page_idx, mask=page_ok, other=0).to(tl.int64)
        pos = page_idx * PAGE + t % PAGE
        tok_ok = page_ok & (pos < seq_len)
        off = page * stride_page + (t % PAGE) * stride_tok + head_off
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=tok_ok[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # [GPAD, tokens]
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    has = l_sum > 0
    out = acc * (v_scale / tl.where(has, l_sum, 1.0))[:, None]
    if NUM_SPLITS == 1:
        row1 = b * HQ + h * GROUP + g
        tl.store(out_ptr + row1[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
        row = (b * HQ + h * GROUP + g) * NUM_SPLITS + s
        tl.store(o_ptr + row[:, None] * D + d[None, :], out, mask=g_ok[:, None])
        tl.store(lse_ptr + row, lse, mask=g_ok)


@triton.jit
def _decode_attention_merge_kernel(
    o_ptr,
    lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    HQ: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPAD: tl.constexpr,
    D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    row = tl.program_id(0)  # b * HQ + head
    sp = tl.arange(0, SPAD)
    d = tl.arange(0, D)
    sp_ok = sp < NUM_SPLITS
    lse = tl.load(lse_ptr + row * NUM_SPLITS + sp, mask=sp_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top)
    o = tl.load(o_ptr + (row * NUM_SPLITS + sp)[:, None] * D + d[None, :], mask=sp_ok[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    merged = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + (row // HQ) * stride_ob + (row % HQ) * stride_oh + d
    tl.store(dst, merged.to(out_ptr.dtype.element_ty))


def supports(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> bool:
    group = num_heads // num_kv_heads
    pow2 = head_dim & (head_dim - 1) == 0 and page_size & (page_size - 1) == 0
    return group <= GROUP_PAD and pow2 and head_dim >= 16 and page_size * PAGES_PER_TILE >= 16


def num_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    return max(1, min(16, -(-num_sms // (batch * num_kv_heads))))


@dataclass(frozen=True)
class TileConfig:
    pages_per_tile: int = PAGES_PER_TILE
    num_warps: int = 4
    num_stages: int = 2


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    splits: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tile: TileConfig | None = None,
    launch_pdl: bool = False,
) -> torch.Tensor:
    """q: [B, Hq, D]; k_cache/v_cache: one layer's `[pages, page_size, Hkv, D]` views (16-bit or e4m3 with its
    scales); the CSR tensors as flashinfer's decode plan takes them. Returns [B, Hq, D] in q's dtype."""
    tile = tile or TileConfig()
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(2) != d or k_cache.stride(3) != 1:
        raise ValueError("K and V caches need the same strides with each token's heads contiguous")
    if q.stride(2) != 1:
        raise ValueError("q rows must be contiguous")
    kv_fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    part = lse = out  # unused with one split
    if splits > 1:
        part = torch.empty(b * hq * splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b * hq * splits, dtype=torch.float32, device=q.device)
    _decode_attention_split_kernel[(b, hkv, splits)](
        q,
        k_cache,
        v_cache,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        part,
        lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        d**-0.5 * k_scale,
        v_scale,
        out,
        NUM_SPLITS=splits,
        GROUP=hq // hkv,
        HQ=hq,
        PAGE=page,
        D=d,
        GPAD=GROUP_PAD,
        PPT=tile.pages_per_tile,
        KV_FP8=kv_fp8,
        PDL=launch_pdl,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl.launch_options(launch_pdl),
    )
    if splits > 1:
        merge_splits(part, lse, out, splits, launch_pdl)
    return out


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, splits: int, launch_pdl: bool) -> None:
    """out [B, H, D] (rows contiguous, any batch and head strides) from each (request, head)'s `splits` partial
    outputs `part` [B * H * splits, D] float32 and their log-sum-exps `lse` [B * H * splits]."""
    b, h, d = out.shape
    _decode_attention_merge_kernel[(b * h,)](
        part,
        lse,
        out,
        out.stride(0),
        out.stride(1),
        HQ=h,
        NUM_SPLITS=splits,
        SPAD=max(2, triton.next_power_of_2(splits)),
        D=d,
        PDL=launch_pdl,
        **pdl.launch_options(launch_pdl),
    )
