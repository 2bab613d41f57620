"""Split-KV decode of latent attention (MLA, absorbed) for small batches (Triton), over the latent pool's pages.

flashinfer's MLA kernel gives a request too few programs at small batch. Here one program per (request, block of
16 query heads, split) loads each tile of its pages' latent and RoPE parts once and scores every head of the block
against it (the heads share the one latent "head"), then the splits merge by log-sum-exp with the dense split-KV
kernel's merge. The split count is fixed per batch size, so a CUDA graph captures the grid; each request's pages
are divided among the splits on the device from its length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.engine.gpu import pdl
from common.engine.gpu.decode_attention import TileConfig, merge_splits, num_splits

HEAD_BLOCK = 16  # query heads per program: the MMA's narrow side; more would not fit the [heads, rank] accumulator
TILE_TOKENS = 32  # tokens gathered per iteration: a [32, kv_lora_rank] latent tile per pipeline stage


@triton.jit
def _mla_decode_split_kernel(
    qn_ptr,
    qp_ptr,
    ckv_ptr,
    kpe_ptr,
    indptr_ptr,
    indices_ptr,
    lens_ptr,
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_qnb,
    stride_qnh,
    stride_qpb,
    stride_qph,
    stride_page,
    stride_tok,
    stride_ob,
    stride_oh,
    sm_scale,
    NUM_SPLITS: tl.constexpr,
    H: tl.constexpr,
    HB: tl.constexpr,
    PAGE: tl.constexpr,
    R: tl.constexpr,
    P: tl.constexpr,
    PPT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    b = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    p0 = tl.load(indptr_ptr + b)
    n_pages = tl.load(indptr_ptr + b + 1) - p0
    seq_len = tl.load(lens_ptr + b)
    # Whole tiles per split: a split boundary inside a tile would load pages twice.
    per_split = tl.cdiv(tl.cdiv(n_pages, NUM_SPLITS), PPT) * PPT
    lo = s * per_split
    hi = tl.minimum(lo + per_split, n_pages)

    h = hb * HB + tl.arange(0, HB)
    h_ok = h < H
    r = tl.arange(0, R)
    e = tl.arange(0, P)
    qn = tl.load(qn_ptr + b * stride_qnb + h[:, None] * stride_qnh + r[None, :], mask=h_ok[:, None], other=0.0)
    qp = tl.load(qp_ptr + b * stride_qpb + h[:, None] * stride_qph + e[None, :], mask=h_ok[:, None], other=0.0)

    m = tl.full([HB], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([HB], dtype=tl.float32)
    acc = tl.zeros([HB, R], dtype=tl.float32)
    t = tl.arange(0, PPT * PAGE)
    for first in range(lo, hi, PPT):
        page_idx = first + t // PAGE
        page_ok = page_idx < hi
        page = tl.load(indices_ptr + p0 + page_idx, mask=page_ok, other=0).to(tl.int64)
        tok_ok = page_ok & (page_idx * PAGE + t % PAGE < seq_len)
        off = page * stride_page + (t % PAGE) * stride_tok
        c = tl.load(ckv_ptr + off[:, None] + r[None, :], mask=tok_ok[:, None], other=0.0)  # [tokens, R]
        kp = tl.load(kpe_ptr + off[:, None] + e[None, :], mask=tok_ok[:, None], other=0.0)  # [tokens, P]
        scores = (tl.dot(qn, tl.trans(c)) + tl.dot(qp, tl.trans(kp))) * sm_scale  # [HB, tokens]
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)  # the latent tile is the values too
        m = m_new
    has = l_sum > 0
    out = acc / tl.where(has, l_sum, 1.0)[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + b * stride_ob + h[:, None] * stride_oh + r[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        # The merge's layout: row (request, head), then split.
        lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
        row = (b * H + h) * NUM_SPLITS + s
        tl.store(part_ptr + row[:, None] * R + r[None, :], out, mask=h_ok[:, None])
        tl.store(lse_ptr + row, lse, mask=h_ok)


def supports(kv_lora_rank: int, rope_dim: int, page_size: int) -> bool:
    """Power-of-two widths (Triton's blocks) and a tile of at least 16 tokens (the MMA's K side)."""
    dims = (kv_lora_rank, rope_dim, page_size)
    return all(x > 0 and x & (x - 1) == 0 for x in dims) and kv_lora_rank >= 16 and rope_dim >= 16


def head_blocks(num_heads: int) -> int:
    return -(-num_heads // HEAD_BLOCK)


def splits_for(batch: int, num_heads: int, num_sms: int) -> int:
    """The dense kernel's rule with a block of heads in place of a KV head."""
    return num_splits(batch, head_blocks(num_heads), num_sms)


def default_tile(page_size: int) -> TileConfig:
    return TileConfig(pages_per_tile=max(1, TILE_TOKENS // page_size))


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    splits: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    tile: TileConfig | None = None,
    launch_pdl: bool = False,
) -> torch.Tensor:
    """One query token per request. q_nope: [B, H, kv_lora_rank] (absorbed), q_pe: [B, H, rope] (roped); ckv / kpe:
    one layer's `[pages, page_size, width]` views of the latent pool (the same page and token strides); the page
    CSR and each request's KV length as flashinfer's MLA plan takes them. Returns [B, H, kv_lora_rank] in q's
    dtype, written into `out` where given (any batch and head strides)."""
    b, h, r = q_nope.shape
    _, page, p = kpe.shape
    tile = tile or default_tile(page)
    if ckv.stride()[:2] != kpe.stride()[:2] or ckv.stride(2) != 1 or kpe.stride(2) != 1:
        raise ValueError("the latent and RoPE parts need the same page and token strides, each row contiguous")
    if q_nope.stride(2) != 1 or q_pe.stride(2) != 1:
        raise ValueError("query rows must be contiguous")
    if out is None:
        out = torch.empty(b, h, r, dtype=q_nope.dtype, device=q_nope.device)
    elif out.stride(2) != 1:
        raise ValueError("output rows must be contiguous")
    part = lse = out  # unused with one split
    if splits > 1:
        part = torch.empty(b * h * splits, r, dtype=torch.float32, device=q_nope.device)
        lse = torch.empty(b * h * splits, dtype=torch.float32, device=q_nope.device)
    _mla_decode_split_kernel[(b, head_blocks(h), splits)](
        q_nope,
        q_pe,
        ckv,
        kpe,
        kv_indptr,
        kv_indices,
        kv_lens,
        part,
        lse,
        out,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        ckv.stride(0),
        ckv.stride(1),
        out.stride(0),
        out.stride(1),
        sm_scale,
        NUM_SPLITS=splits,
        H=h,
        HB=HEAD_BLOCK,
        PAGE=page,
        R=r,
        P=p,
        PPT=tile.pages_per_tile,
        PDL=launch_pdl,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl.launch_options(launch_pdl),
    )
    if splits > 1:
        merge_splits(part, lse, out, splits, launch_pdl)
    return out
