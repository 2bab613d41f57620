"""One file because every prologue and epilogue is a branch of one kernel. Skinny GEMMs (decode steps of a few rows) with the elementwise op before them folded into their prologue and
the one after into their epilogue, removing a launch and a memory round trip each (docs/architecture.md, "GPU
kernels"). Prologues: `norm`, `add_norm` (also returns the new residual), `silu`, `none`, `stream_norm` (from the
row statistics an `into_stream` GEMV left). Epilogues: `gated` (silu(gate) * up), `kv_write` (RoPE and the K/V
write), `into_stream` (s += x @ W^T plus per-program sums of squares, in program order: deterministic).
Each program streams `BLOCK_N` rows of W and recomputes x's row statistics itself, so programs never sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.engine.fp8 import is_fp8
from common.engine.gpu import pdl
from common.engine.gpu.rope_store import kv_value
from common.engine.layers import KvWrite

PROLOGUES = {"none": 0, "norm": 1, "add_norm": 2, "silu": 3, "stream_norm": 4}
MAX_ROWS = 16  # the dot kernel's row tile


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def launch_meta(self) -> dict[str, int]:
        """The tile as the launch keywords of every GEMV kernel (this one's and the MoE experts')."""
        return dict(BLOCK_N=self.block_n, BLOCK_K=self.block_k, NUM_STAGES=self.num_stages, num_warps=self.num_warps)


def pick_config(rows: int, n: int, w_fp8: bool = False, k: int = 0) -> GemvConfig:
    """Block shapes by bench/decode_kernels.py's sweep (8B shapes): one row 8 x 512 (8 x 256 widest), a few rows
    64-row MMA tiles, FP8 one row 8 x 1024 (32 x 256 widest). `k` completes the shape; no rule needs it today."""
    if rows == 1 and w_fp8:
        if n > 16384:
            return GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
        return GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3)
    if rows == 1:
        return GemvConfig(block_n=8, block_k=512 if n <= 16384 else 256, num_warps=4, num_stages=3)
    if n <= 8192:
        return GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=3)
    return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)


def _heads_fit(cfg: GemvConfig, n: int, kv_heads: int, head_dim: int) -> bool:
    """A [q; k; v] weight of `n` rows in whole heads, whose rotation pairs the tile's two halves can hold."""
    return n % head_dim == 0 and n > 2 * kv_heads * head_dim and head_dim % cfg.block_n == 0 and cfg.block_n % 2 == 0


def kv_write_fits(rows: int, weight: torch.Tensor, kv_write: KvWrite) -> bool:
    n, k = weight.shape
    hkv, head_dim = kv_write.rows.shape[1:]
    return _heads_fit(pick_config(rows, n, is_fp8(weight.dtype), k), n, hkv, head_dim)


@triton.jit
def gated_rows(pid, N, BLOCK_N: tl.constexpr):
    """The weight rows of a gated tile over N = I output columns ([gate; up], 2I rows): its first half are gate
    rows, its second the matching up rows. (rows, their columns' mask)."""
    HALF: tl.constexpr = BLOCK_N // 2
    ri = tl.arange(0, BLOCK_N)
    col = pid * HALF + ri % HALF
    return tl.where(ri < HALF, col, N + col), col < N


@triton.jit
def zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
    """The accumulator of `accumulate`: the MMA's `[BLOCK_N, BLOCK_M]`, or one row's `[BLOCK_N, BLOCK_K]` FMA lanes."""
    if USE_DOT:
        return tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)


@triton.jit
def accumulate(acc, w, a, USE_DOT: tl.constexpr):
    """acc + the weight tile w `[BLOCK_N, BLOCK_K]` times the rows a `[BLOCK_M, BLOCK_K]` (float32)."""
    if USE_DOT:
        # Swapped operands: the weight tile is the MMA's tall side, the few rows its narrow side.
        acc += tl.dot(w, tl.trans(a.to(w.dtype)))
    else:
        acc += w.to(tl.float32) * a  # a: [1, BLOCK_K], broadcast over the BLOCK_N rows
    return acc


@triton.jit
def acc_rows(acc, USE_DOT: tl.constexpr):
    """The accumulator as the product's rows, `[BLOCK_M, BLOCK_N]`."""
    if USE_DOT:
        return tl.trans(acc)
    else:
        return tl.sum(acc, axis=1)[None, :]


@triton.jit
def silu_mul_halves(out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """silu(gate) * up of a gated tile's product `[BLOCK_M, BLOCK_N]` (`gated_rows`): `[BLOCK_M, BLOCK_N / 2]`."""
    HALF: tl.constexpr = BLOCK_N // 2
    gate, up = tl.split(tl.permute(tl.reshape(out, [BLOCK_M, 2, HALF]), [0, 2, 1]))
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _gemv_kernel(
    x_ptr,
    r_ptr,
    nw_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    r_out_ptr,
    stats_ptr,
    pos_ptr,
    cs_ptr,
    loc_ptr,
    kv_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_ym,
    stride_sm,
    stats_parts,
    eps,
    k_off,
    v_off,
    k_inv_scale,
    v_inv_scale,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_FP8: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_POW2: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    INTO_STREAM: tl.constexpr,
    PARTS_POW2: tl.constexpr,
    GATED: tl.constexpr,
    ROPE: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_ROUND: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    if ROPE:  # a head's rotation pairs: the tile's first half are dims j.., its second the dims j + D / 2 ..
        PAIRS: tl.constexpr = BLOCK_N // 2
        PER_HEAD: tl.constexpr = HEAD_DIM // BLOCK_N  # programs per head
        head = pid // PER_HEAD
        ri = tl.arange(0, BLOCK_N)
        dim = (pid % PER_HEAD) * PAIRS + ri % PAIRS
        rn = head * HEAD_DIM + tl.where(ri < PAIRS, dim, dim + HEAD_DIM // 2)
        n_ok = rn < N
    elif GATED:
        rn, n_ok = gated_rows(pid, N, BLOCK_N)
    else:
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
    pdl.start(PDL)
    rm = tl.arange(0, BLOCK_M)
    rk0 = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    x_rows = x_ptr + rm[:, None] * stride_xm
    r_rows = r_ptr + rm[:, None] * stride_rm

    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        # The row statistics in one load of the whole row (a few KB from L2), not a loop of dependent loads.
        rk_all = tl.arange(0, K_POW2)
        mk_all = m_ok[:, None] & (rk_all < K)[None, :]
        s = tl.load(x_rows + rk_all[None, :], mask=mk_all, other=0.0).to(tl.float32)
        if PROLOGUE == 2:
            s += tl.load(r_rows + rk_all[None, :], mask=mk_all, other=0.0).to(tl.float32)
            # The unfused path norms the residual as stored (16-bit): round the same way.
            s = s.to(y_ptr.dtype.element_ty).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(s * s, axis=1) / K + eps)

    if PROLOGUE == 4:
        # Loaded here, used after the loop: its latency hides behind the weight stream.
        rp = tl.arange(0, PARTS_POW2)
        parts = tl.load(
            stats_ptr + rm[:, None] * stride_sm + rp[None, :],
            mask=m_ok[:, None] & (rp < stats_parts)[None, :],
            other=0.0,
        )

    if ROPE:  # each row's position, cos/sin and pool row, loaded before the weight stream as the statistics are
        jj = (pid % PER_HEAD) * PAIRS + tl.arange(0, PAIRS)
        pos = tl.load(pos_ptr + rm, mask=m_ok, other=0).to(tl.int64)
        cos = tl.load(cs_ptr + pos[:, None] * HEAD_DIM + jj[None, :], mask=m_ok[:, None], other=1.0)
        sin = tl.load(cs_ptr + pos[:, None] * HEAD_DIM + HEAD_DIM // 2 + jj[None, :], mask=m_ok[:, None], other=0.0)
        loc = tl.load(loc_ptr + rm, mask=m_ok, other=0).to(tl.int64)

    acc = zero_acc(BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + rk0
        k_ok = rk < K
        mk = m_ok[:, None] & k_ok[None, :]
        if PROLOGUE == 3:
            g = tl.load(x_rows + rk[None, :], mask=mk, other=0.0).to(tl.float32)
            u = tl.load(x_rows + K + rk[None, :], mask=mk, other=0.0).to(tl.float32)
            a = g / (1.0 + tl.exp(-g)) * u
        else:
            a = tl.load(x_rows + rk[None, :], mask=mk, other=0.0).to(tl.float32)
            if PROLOGUE == 2:
                a += tl.load(r_rows + rk[None, :], mask=mk, other=0.0).to(tl.float32)
                a = a.to(y_ptr.dtype.element_ty)
                tl.store(r_out_ptr + rm[:, None] * stride_rm + rk[None, :], a, mask=mk & (pid == 0))
                a = a.to(tl.float32)
            if PROLOGUE == 1 or PROLOGUE == 2:
                nw = tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
                a = a * rstd[:, None] * nw[None, :]
            if PROLOGUE == 4:
                a = a * tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if W_FP8 and USE_DOT:  # e4m3 weights: the MMA runs in the activations' dtype, row scales at the end
            w = w.to(y_ptr.dtype.element_ty)
        acc = accumulate(acc, w, a, USE_DOT)
    out = acc_rows(acc, USE_DOT)
    if W_FP8:
        out = out * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if PROLOGUE == 4:
        out = out * tl.rsqrt(tl.sum(parts, axis=1) / K + eps)[:, None]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    mn = m_ok[:, None] & n_ok[None, :]
    if INTO_STREAM:
        out += tl.load(r_rows + rn[None, :], mask=mn, other=0.0).to(tl.float32)
        # The statistics of the stream as stored (16-bit), as the norm kernel would read it.
        out = out.to(y_ptr.dtype.element_ty).to(tl.float32)
        sq = tl.where(mn, out * out, 0.0)
        tl.store(stats_ptr + rm * stride_sm + pid, tl.sum(sq, axis=1), mask=m_ok)
    if ROPE:
        # Rotated from the projection as stored (16-bit), as the unfused RoPE kernel reads it.
        out = out.to(y_ptr.dtype.element_ty).to(tl.float32)
        x1, x2 = tl.split(tl.permute(tl.reshape(out, [BLOCK_M, 2, PAIRS]), [0, 2, 1]))
        rotate = head < HQ + HKV  # q and k heads; v heads are stored as they are
        r1 = tl.where(rotate, x1 * cos - x2 * sin, x1)
        r2 = tl.where(rotate, x2 * cos + x1 * sin, x2)
        mp = m_ok[:, None]
        if head < HQ:
            q_dst = y_ptr + rm[:, None] * stride_ym + head * HEAD_DIM + jj[None, :]
            tl.store(q_dst, r1.to(y_ptr.dtype.element_ty), mask=mp)
            tl.store(q_dst + HEAD_DIM // 2, r2.to(y_ptr.dtype.element_ty), mask=mp)
        else:
            is_v = head >= HQ + HKV
            kv_head = head - HQ - tl.where(is_v, HKV, 0)
            inv = tl.where(is_v, v_inv_scale, k_inv_scale)
            row = loc + tl.where(is_v, v_off, k_off)
            kv_dst = kv_ptr + row[:, None] * (HKV * HEAD_DIM) + kv_head * HEAD_DIM + jj[None, :]
            tl.store(kv_dst, kv_value(r1, inv, kv_ptr, KV_FP8, KV_ROUND), mask=mp)
            tl.store(kv_dst + HEAD_DIM // 2, kv_value(r2, inv, kv_ptr, KV_FP8, KV_ROUND), mask=mp)
    elif GATED:
        act = silu_mul_halves(out, BLOCK_M, BLOCK_N)
        ro = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(
            y_ptr + rm[:, None] * stride_ym + ro[None, :],
            act.to(y_ptr.dtype.element_ty),
            mask=m_ok[:, None] & (ro < N)[None, :],
        )
    else:
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty), mask=mn)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: str = "none",
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
    launch_pdl: bool = False,
    norm_stats: torch.Tensor | None = None,
    into_stream: torch.Tensor | None = None,
    gated: bool = False,
    kv_write: KvWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, new residual or None) for `x` of at most `MAX_ROWS` rows (the module doc says what each mode does).
    `into_stream`: returns (the stream, y added in place, and its float32 `[m, programs]` statistics). An FP8
    `weight` comes with float32 `weight_scale` per output row and is widened in registers. `kv_write`: returns
    (the rotated q `[m, Hq, D]`, None). `launch_pdl`: a programmatic dependent launch (Hopper)."""
    m = x.shape[0]
    n, k = weight.shape
    code = PROLOGUES[prologue]
    if m > MAX_ROWS or m == 0:
        raise ValueError(f"gemv serves 1..{MAX_ROWS} rows, not {m}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("gemv needs unit-stride rows")
    if n * weight.stride(0) >= 1 << 31:
        raise ValueError("gemv indexes the weight with 32-bit offsets: this one is too large")
    w_fp8 = weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if w_fp8 != (weight_scale is not None):
        raise ValueError("an FP8 weight needs its weight_scale (and only an FP8 weight takes one)")
    if code == 3 and x.shape[1] != 2 * k:
        raise ValueError(f"silu prologue: x holds gate | up ({2 * k} columns), not {x.shape[1]}")
    if code != 3 and x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, weight {k}")
    if (code == 4) != (norm_stats is not None):
        raise ValueError("the stream_norm prologue needs norm_stats (and only it takes them)")
    if into_stream is not None and (code in (2, 4) or into_stream.shape != (m, n) or into_stream.stride(-1) != 1):
        raise ValueError(
            f"into_stream is the [{m}, {n}] unit-stride residual stream (and not with add_norm or stream_norm)"
        )
    if gated and (n % 2 or bias is not None or into_stream is not None):
        raise ValueError("gated: an even number of weight rows ([gate; up]), no bias and no into_stream")
    one = m == 1
    cfg = config or pick_config(m, n, w_fp8, k)
    # A [q; k; v] weight's heads (0 without kv_write: one compiled variant for every other call).
    hq = hkv = head_dim = 0
    if kv_write is not None:
        hkv, head_dim = kv_write.rows.shape[1:]
        hq = (n - 2 * hkv * head_dim) // head_dim
    if kv_write is not None and (
        gated
        or into_stream is not None
        or not _heads_fit(cfg, n, hkv, head_dim)
        or kv_write.positions.shape[0] != m
        or kv_write.out_rows.shape[0] != m
        or not kv_write.rows.is_contiguous()
    ):
        raise ValueError(
            f"kv_write: a [q; k; v] weight of whole {head_dim}-wide heads, tiles of an even block_n dividing the "
            f"head ({cfg.block_n}), one position and pool row per x row, and no gated or into_stream epilogue"
        )
    if gated and cfg.block_n % 2:
        raise ValueError("gated tiles pair gate and up rows: block_n must be even")
    out_n = n // 2 if gated else n
    programs = triton.cdiv(out_n, cfg.block_n // 2 if gated else cfg.block_n)
    stats = norm_stats  # read by stream_norm, written by into_stream
    if into_stream is not None:
        y = into_stream
        stats = torch.empty(m, programs, dtype=torch.float32, device=x.device)
    elif kv_write is not None:
        y = torch.empty(m, hq, head_dim, dtype=x.dtype, device=x.device)  # the rotated q; K and V go to the pool
    else:
        y = torch.empty(m, out_n, dtype=x.dtype, device=x.device)
    r_out = None
    if code == 2:
        assert residual is not None and residual.stride(-1) == 1
        r_out = torch.empty_like(x)
    r = into_stream if into_stream is not None else residual if residual is not None else x
    if r_out is not None and r_out.stride(0) != r.stride(0):
        raise ValueError("residual and its output must share a row stride")
    _gemv_kernel[(programs,)](
        x,
        r,
        norm_weight if norm_weight is not None else x,
        weight,
        weight_scale if weight_scale is not None else x,
        bias if bias is not None else x,
        y,
        r_out if r_out is not None else y,
        stats if stats is not None else x,
        kv_write.positions if kv_write is not None else x,
        kv_write.cos_sin if kv_write is not None else x,
        kv_write.out_rows if kv_write is not None else x,
        kv_write.rows if kv_write is not None else x,
        m,
        n if kv_write is not None else out_n,
        k,
        x.stride(0),
        r.stride(0),
        weight.stride(0),
        y.stride(0),
        stats.stride(0) if stats is not None else 0,
        stats.shape[1] if stats is not None else 0,
        eps,
        kv_write.k_offset if kv_write is not None else 0,
        kv_write.v_offset if kv_write is not None else 0,
        1.0 / kv_write.k_scale if kv_write is not None else 1.0,
        1.0 / kv_write.v_scale if kv_write is not None else 1.0,
        PROLOGUE=code,
        HAS_BIAS=bias is not None,
        W_FP8=w_fp8,
        USE_DOT=not one,
        BLOCK_M=1 if one else MAX_ROWS,
        K_POW2=triton.next_power_of_2(k) if code in (1, 2) else 16,
        INTO_STREAM=into_stream is not None,
        PARTS_POW2=triton.next_power_of_2(stats.shape[1]) if code == 4 else 16,
        GATED=gated,
        ROPE=kv_write is not None,
        HQ=hq,
        HKV=hkv,
        HEAD_DIM=head_dim,
        KV_FP8=kv_write is not None and is_fp8(kv_write.rows.dtype),
        # Round to nearest even into FP8, as torch does; None keeps a 16-bit pool's default.
        KV_ROUND="rtne" if kv_write is not None and is_fp8(kv_write.rows.dtype) else None,
        PDL=launch_pdl,
        **cfg.launch_meta(),
        **pdl.launch_options(launch_pdl),
    )
    return y, (stats if into_stream is not None else r_out)
