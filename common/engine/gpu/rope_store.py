"""RoPE on q and k and the layer's K/V write into the paged pool, in one launch (unfused: three kernels a
layer, costing more in launches than in bytes at batch 1). Neox half-split over flashinfer's cos/sin table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.engine.fp8 import is_fp8
from common.engine.gpu import pdl


@triton.jit
def kv_value(x, inv_scale, rows_ptr, FP8: tl.constexpr, ROUND: tl.constexpr):
    """float32 `x` as the pool stores it (FP8: value / scale, saturated and rounded to nearest even)."""
    if FP8:
        x = tl.clamp(x * inv_scale, -448.0, 448.0)
    return x.to(rows_ptr.dtype.element_ty, fp_downcast_rounding=ROUND)


@triton.jit
def _rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cs_ptr,
    qo_ptr,
    rows_ptr,
    loc_ptr,
    stride_qt,
    stride_kt,
    stride_vt,
    k_off,
    v_off,
    k_inv_scale,
    v_inv_scale,
    FP8: tl.constexpr,
    ROUND: tl.constexpr,
    Q_FP8: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    HEADS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    t = tl.program_id(0)
    hh = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # this program's heads: queries first, then KV heads
    d = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * (2 * HALF) + d)[None, :]
    sin = tl.load(cs_ptr + pos * (2 * HALF) + HALF + d)[None, :]
    loc = tl.load(loc_ptr + t).to(tl.int64)
    row_elems = HKV * 2 * HALF
    is_q = hh < HQ
    is_kv = (hh >= HQ) & (hh < HQ + HKV)
    kh = tl.where(is_kv, hh - HQ, 0)
    qh = tl.where(is_q, hh, 0)
    src = tl.where(is_q, q_ptr + t * stride_qt + qh * (2 * HALF), k_ptr + t * stride_kt + kh * (2 * HALF))
    qdst = qo_ptr + (t * HQ + qh) * (2 * HALF)
    kdst = rows_ptr + (loc + k_off) * row_elems + kh * (2 * HALF)
    ok = (is_q | is_kv)[:, None]
    qmask = is_q[:, None]
    vmask = is_kv[:, None]
    x1 = tl.load(src[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src[:, None] + HALF + d[None, :], mask=ok, other=0.0).to(tl.float32)
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    if Q_FP8:  # e4m3 queries at scale 1.0 for FA3's FP8 prefill, saturated as common/engine/fp8.py does
        # Rounded to the model's 16 bits first: the bytes a cast of a 16-bit q writes.
        q1 = tl.clamp(r1.to(q_ptr.dtype.element_ty).to(tl.float32), -448.0, 448.0)
        q2 = tl.clamp(r2.to(q_ptr.dtype.element_ty).to(tl.float32), -448.0, 448.0)
        q1 = q1.to(qo_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        q2 = q2.to(qo_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    else:
        q1 = r1.to(qo_ptr.dtype.element_ty)
        q2 = r2.to(qo_ptr.dtype.element_ty)
    tl.store(qdst[:, None] + d[None, :], q1, mask=qmask)
    tl.store(qdst[:, None] + HALF + d[None, :], q2, mask=qmask)
    tl.store(kdst[:, None] + d[None, :], kv_value(r1, k_inv_scale, rows_ptr, FP8, ROUND), mask=vmask)
    tl.store(kdst[:, None] + HALF + d[None, :], kv_value(r2, k_inv_scale, rows_ptr, FP8, ROUND), mask=vmask)
    vsrc = v_ptr + t * stride_vt + kh * (2 * HALF)
    vdst = rows_ptr + (loc + v_off) * row_elems + kh * (2 * HALF)
    for half in tl.static_range(2):
        val = tl.load(vsrc[:, None] + half * HALF + d[None, :], mask=vmask, other=0.0).to(tl.float32)
        tl.store(vdst[:, None] + half * HALF + d[None, :], kv_value(val, v_inv_scale, rows_ptr, FP8, ROUND), mask=vmask)


def supports(head_dim: int) -> bool:
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0


def rope_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    rows: torch.Tensor,
    out_rows: torch.Tensor,
    k_offset: int,
    v_offset: int,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_fp8: bool = False,
    launch_pdl: bool = False,
) -> torch.Tensor:
    """Rotated q `[T, Hq, D]` (into `out` where given); rotated k and v written to `rows[out_rows + k_offset]` and
    `rows[out_rows + v_offset]` (FP8: divided by the layer's scales). `q_fp8` (or an e4m3 `out`) writes q in e4m3
    at scale 1.0 for FA3's FP8 prefill."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if q.stride(1) != d or k.stride(1) != d or v.stride(1) != d or q.stride(2) != 1:
        raise ValueError("rope_store needs each token's heads contiguous")
    if out is None:
        out = torch.empty(t, hq, d, dtype=torch.float8_e4m3fn if q_fp8 else q.dtype, device=q.device)
    if t == 0:
        return out
    # Few tokens: two heads per program (the most parallel grid); many: 16, not a grid of tiny programs.
    heads = 2 if t <= 64 else 16
    _rope_store_kernel[(t, triton.cdiv(hq + hkv, heads))](
        q,
        k,
        v,
        positions,
        cos_sin,
        out,
        rows,
        out_rows,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        k_offset,
        v_offset,
        1.0 / k_scale,
        1.0 / v_scale,
        FP8=is_fp8(rows.dtype),
        # Round to nearest even into FP8, as torch does; None keeps a 16-bit pool's default.
        ROUND="rtne" if is_fp8(rows.dtype) else None,
        Q_FP8=is_fp8(out.dtype),
        HQ=hq,
        HKV=hkv,
        HALF=d // 2,
        HEADS=heads,
        PDL=launch_pdl,
        num_warps=1 if heads == 2 else 4,
        **pdl.launch_options(launch_pdl),
    )
    return out
