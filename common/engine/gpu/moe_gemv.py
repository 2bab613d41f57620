"""The experts of a mixture-of-experts layer at a few tokens as two GEMV kernels that read each routed expert's
weights once, straight from the stacked `w13` / `w2` by expert id: no sort, no gather of tokens or weights, no
host sync, two launches a layer.

At decode batch sizes a layer routes T tokens to T * k (token, choice) pairs over at most T * k distinct
experts, a few rows each: the grouped GEMM's row tiles are mostly padding and its sort / scatter / gather /
combine kernels cost more than the weights they move. Here:

- gate_up: a program per (pair, block of the intermediate columns). The pair's expert serves every token that
  routes to it (read off the `[T, k]` ids), and only the program of its first pair in (token, choice) order
  runs; the others mask every load off. Its tile is [gate; up] rows as the dense gated GEMV takes them
  (`fused_gemv.gated_rows`), silu(gate) * up in its epilogue, written as each routed token's pair row of a
  float32 `[T * k, I]` buffer.
- down: a program per block of the hidden columns runs over the pairs' K tiles as one loop (no loop boundary
  between experts to drain the weight stream at), each expert once at its first pair, its rows scaled by their
  tokens' routing weights: the sum over a token's k choices is this program's float32 accumulator, added in a
  fixed order (the experts' first pairs), with no atomics, so the output is deterministic.

One row (T = 1) runs the FMA loop of the dense GEMV; a few rows its swapped-operand `tl.dot`. All grids and
shapes follow T, k and the weights' sizes, so a captured CUDA graph replays them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.engine.gpu.fused_gemv import (
    MAX_ROWS,
    GemvConfig,
    acc_rows,
    accumulate,
    gated_rows,
    pick_config,
    silu_mul_halves,
    zero_acc,
)
from common.engine.moe import ExpertsFn

__all__ = ["MAX_TOKENS", "DecodeExperts", "experts_config", "gemv_experts"]

# One token's k choices are distinct experts, so at 8 tokens a layer touches at most 8k of its experts with a few
# rows each (Qwen3-30B-A3B: 64 pairs over 128 experts); the dot kernel's row tile holds up to MAX_ROWS tokens.
MAX_TOKENS = MAX_ROWS
# The most tokens the serving path gives these kernels: on an H200 (Qwen3-30B-A3B's experts) they beat the
# grouped GEMMs at one token (28 vs 79 us a layer, at the copy rate) and lose from two on (137 vs 119, 258 vs 163,
# 492 vs 245 us at 2 / 4 / 8): a few tokens' routed experts overlap little, so the grouped GEMM's one pass
# per expert wins once its fixed cost is spread (bench/RESULTS.md, "The GEMV experts' tiles").
SERVING_TOKENS = 1


def experts_config(tokens: int, n: int, min_programs: int = 0) -> GemvConfig:
    """One token: the dense GEMV's one-row tiles, narrowed (to 4 rows at least) until `n` rows make `min_programs`
    programs. A few: 16-row weight tiles (the MMA's smallest side), so the down kernel's grid (hidden / block_n
    programs) still covers the SMs. Not yet swept on a GPU (bench/moe_gemv_tiles.py)."""
    if tokens > 1:
        return GemvConfig(block_n=16, block_k=128, num_warps=4, num_stages=3)
    cfg = pick_config(1, n)
    block_n = cfg.block_n
    while block_n > 4 and triton.cdiv(n, block_n) < min_programs:
        block_n //= 2
    return GemvConfig(block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)


# The down kernel's one-token grid: as many programs as the dense 8B's o projection GEMV (4096 rows of 8) has, to keep
# as many weight loads in flight; the gate_up kernel's grid has a row of programs per routed expert already.
DOWN_MIN_PROGRAMS = 512


@triton.jit
def _routed_rows(ids_ptr, e, p, rm, m_ok, TOP_K: tl.constexpr, TOPK_POW2: tl.constexpr):
    """For expert e, met at pair p: (which of the rows rm route to it `[BLOCK_M]`, each one's pair index, the
    hits `[BLOCK_M, TOPK_POW2]` over their pairs, whether p is e's first pair in (token, choice) order)."""
    rj = tl.arange(0, TOPK_POW2)
    pairs = rm[:, None] * TOP_K + rj[None, :]
    ok = m_ok[:, None] & (rj < TOP_K)[None, :]
    hit = (tl.load(ids_ptr + pairs, mask=ok, other=-1) == e) & ok
    routed = tl.sum(hit.to(tl.int32), axis=1) > 0
    pair = tl.sum(tl.where(hit, pairs, 0), axis=1)
    first = tl.sum((hit & (pairs < p)).to(tl.int32)) == 0
    return routed, pair, hit, first


@triton.jit
def _experts_gate_up_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    act_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,
    TOPK_POW2: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    p = tl.program_id(0)
    pid = tl.program_id(1)
    e = tl.load(ids_ptr + p)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    routed, pair, _, first = _routed_rows(ids_ptr, e, p, rm, m_ok, TOP_K, TOPK_POW2)
    rows_ok = tl.where(first, routed, False)
    rn, n_ok = gated_rows(pid, N, BLOCK_N)
    w_rows = w_ptr + e.to(tl.int64) * stride_we + rn[:, None] * stride_wn
    rk0 = tl.arange(0, BLOCK_K)
    acc = zero_acc(BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + rk0
        k_ok = rk < K
        a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + rk[None, :], mask=tl.where(first, n_ok, False)[:, None] & k_ok[None, :], other=0.0)
        acc = accumulate(acc, w, a.to(tl.float32), USE_DOT)
    act = silu_mul_halves(acc_rows(acc, USE_DOT), BLOCK_M, BLOCK_N)
    ro = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(act_ptr + pair[:, None] * N + ro[None, :], act, mask=rows_ok[:, None] & (ro < N)[None, :])


@triton.jit
def _experts_down_kernel(
    act_ptr,
    ids_ptr,
    wts_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_we,
    stride_wn,
    stride_ym,
    TOP_K: tl.constexpr,
    TOPK_POW2: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk0 = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(K, BLOCK_K)
    acc = zero_acc(BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT)
    for it in tl.range(0, M * TOP_K * k_tiles, num_stages=NUM_STAGES):
        p = it // k_tiles
        rk = (it % k_tiles) * BLOCK_K + rk0
        k_ok = rk < K
        e = tl.load(ids_ptr + p)
        routed, pair, hit, first = _routed_rows(ids_ptr, e, p, rm, m_ok, TOP_K, TOPK_POW2)
        rows_ok = tl.where(first, routed, False)
        # Each routed row's weight for this expert: its token's k weights, the hit one kept.
        hit_w = tl.load(wts_ptr + rm[:, None] * TOP_K + tl.arange(0, TOPK_POW2)[None, :], mask=hit, other=0.0)
        weight = tl.sum(hit_w, axis=1)
        a = tl.load(act_ptr + pair[:, None] * K + rk[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        w_rows = w_ptr + e.to(tl.int64) * stride_we + rn[:, None] * stride_wn
        w = tl.load(w_rows + rk[None, :], mask=tl.where(first, n_ok, False)[:, None] & k_ok[None, :], other=0.0)
        acc = accumulate(acc, w, a * weight[:, None], USE_DOT)
    out = acc_rows(acc, USE_DOT)
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        out.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def gemv_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    gate_up_config: GemvConfig | None = None,
    down_config: GemvConfig | None = None,
) -> torch.Tensor:
    """`common.engine.moe.ExpertsFn` for 1..`MAX_TOKENS` tokens: x `[T, H]`, weights/ids `[T, k]`, w13
    `[E, 2I, H]`, w2 `[E, H, I]` -> `[T, H]` in x's dtype. The configs override the tiles (tests, sweeps)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inner = w2.shape[2]
    if not 0 < tokens <= MAX_TOKENS:
        raise ValueError(f"the GEMV experts serve 1..{MAX_TOKENS} tokens, not {tokens}")
    if w13.shape[1:] != (2 * inner, hidden) or w2.shape[:2] != (w13.shape[0], hidden):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not [E, 2I, H] and [E, H, I]")
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("the GEMV experts need unit-stride rows")
    if max(w13.stride(1) * w13.shape[1], w2.stride(1) * w2.shape[1]) >= 1 << 31:
        raise ValueError("the GEMV experts index within an expert with 32-bit offsets: this one is too large")
    ids = ids.contiguous()
    weights = weights.to(torch.float32).contiguous()
    one = tokens == 1
    meta = dict(
        TOP_K=top_k,
        TOPK_POW2=triton.next_power_of_2(top_k),
        USE_DOT=not one,
        BLOCK_M=1 if one else MAX_ROWS,
    )
    cfg = gate_up_config or experts_config(tokens, 2 * inner)
    if cfg.block_n % 2:
        raise ValueError("gated tiles pair gate and up rows: block_n must be even")
    act = torch.empty(tokens * top_k, inner, dtype=torch.float32, device=x.device)
    _experts_gate_up_kernel[(tokens * top_k, triton.cdiv(inner, cfg.block_n // 2))](
        x,
        ids,
        w13,
        act,
        tokens,
        inner,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        **cfg.launch_meta(),
        **meta,
    )
    cfg = down_config or experts_config(tokens, hidden, DOWN_MIN_PROGRAMS)
    y = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    _experts_down_kernel[(triton.cdiv(hidden, cfg.block_n),)](
        act,
        ids,
        weights,
        w2,
        y,
        tokens,
        hidden,
        inner,
        w2.stride(0),
        w2.stride(1),
        y.stride(0),
        **cfg.launch_meta(),
        **meta,
    )
    return y


@dataclass(frozen=True)
class DecodeExperts:
    """`ExpertsFn` chosen by the step's token count: the GEMV experts up to `max_tokens` tokens, `larger` beyond.
    A shape is all it reads, so a CUDA graph captured at one batch size holds one path."""

    max_tokens: int
    larger: ExpertsFn

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        if 0 < x.shape[0] <= self.max_tokens:
            return gemv_experts(x, weights, ids, w13, w2)
        return self.larger(x, weights, ids, w13, w2)
