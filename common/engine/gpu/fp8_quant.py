"""FP8 quantization kernels (Triton), each one launch: per-token activation scales for the FP8 GEMMs, fused into
the add + RMSNorm and the SiLU-mul that produce the activations, and the plain saturating cast of attention's Q.

Every kernel computes what its unfused twin in common/engine/fp8.py computes on the 16-bit result of the op it
absorbs (flashinfer's fused add + RMSNorm: the sum kept in float32 for the norm, the residual stored in 16 bits;
SiLU-mul in float32): the output is rounded to the activation dtype first, then quantized, so fusing changes
which kernel runs, not the numbers (up to the multiply by the scale's reciprocal instead of a divide).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.engine.fp8 import FP8, FP8_MAX, MIN_AMAX

# The widest hidden size the fused norm holds in one program's registers (a 70B model's is 8192).
NORM_MAX = 16384
# SiLU-mul rows up to this width are read once and held in registers (an 8B model's 14,336); wider ones twice.
SILU_ONE_PASS_MAX = 16384


@triton.jit
def _row_inv_scale(amax, s_ptr, row, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr):
    """Stores the row's scale (its largest magnitude over 448) and returns its reciprocal."""
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX_C) / FP8_MAX_C
    tl.store(s_ptr + row, scale)
    return 1.0 / scale


@triton.jit
def _write_e4m3(q_ptr, offs, mask, y, inv, FP8_MAX_C: tl.constexpr):
    v = tl.clamp(y * inv, -FP8_MAX_C, FP8_MAX_C)
    tl.store(q_ptr + offs, v.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _silu_mul(g_row, cols, mask, N):
    """silu(gate) * up at `cols` of a [gate | up] row, in float32, rounded to the row's dtype (as SiLU-mul writes)."""
    gate = tl.load(g_row + cols, mask=mask, other=0.0)
    up = tl.load(g_row + N + cols, mask=mask, other=0.0).to(tl.float32)
    gf = gate.to(tl.float32)
    return (gf / (1.0 + tl.exp(-gf)) * up).to(gate.dtype).to(tl.float32)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr
):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)))
    inv = _row_inv_scale(amax, s_ptr, row, FP8_MAX_C, MIN_AMAX_C)
    for k0 in range(0, K, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        _write_e4m3(q_ptr + row * K, rk, rk < K, v, inv, FP8_MAX_C)


@triton.jit
def _add_rms_norm_quant_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    N,
    stride_x,
    stride_r,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    MIN_AMAX_C: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    s = x.to(tl.float32)
    if HAS_RESIDUAL:
        s += tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_ptr + row * stride_r + cols, s.to(x.dtype), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (s * rstd * w).to(x.dtype).to(tl.float32)
    inv = _row_inv_scale(tl.abs(y), s_ptr, row, FP8_MAX_C, MIN_AMAX_C)
    _write_e4m3(q_ptr + row * N, cols, mask, y, inv, FP8_MAX_C)


@triton.jit
def _silu_mul_quant_kernel(
    g_ptr,
    q_ptr,
    s_ptr,
    N,
    stride_g,
    ONE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    MIN_AMAX_C: tl.constexpr,
):
    row = tl.program_id(0)
    g_row = g_ptr + row * stride_g
    q_row = q_ptr + row * N
    if ONE_PASS:  # the row held in registers: read once
        cols = tl.arange(0, BLOCK)
        y = _silu_mul(g_row, cols, cols < N, N)
        inv = _row_inv_scale(tl.abs(y), s_ptr, row, FP8_MAX_C, MIN_AMAX_C)
        _write_e4m3(q_row, cols, cols < N, y, inv, FP8_MAX_C)
    else:  # read twice: the row's largest magnitude first, then the values
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, N, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_silu_mul(g_row, cols, cols < N, N)))
        inv = _row_inv_scale(amax, s_ptr, row, FP8_MAX_C, MIN_AMAX_C)
        for k0 in range(0, N, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            _write_e4m3(q_row, cols, cols < N, _silu_mul(g_row, cols, cols < N, N), inv, FP8_MAX_C)


@triton.jit
def _saturate_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _write_e4m3(y_ptr, offs, offs < n, tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32), 1.0, FP8_MAX_C)


def _empty_quantized(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(m, k, dtype=FP8, device=device), torch.empty(m, 1, dtype=torch.float32, device=device)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, K]` contiguous, float32 scales `[M, 1]`): common/engine/fp8.py's `quantize_rows` in one launch."""
    m, k = x.shape
    q, s = _empty_quantized(m, k, x.device)
    if m > 0:
        assert x.stride(1) == 1
        _quantize_rows_kernel[(m,)](
            x, q, s, k, x.stride(0), BLOCK=1024, FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, num_warps=4
        )
    return q, s


def add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 rows, their scales, the residual stream): `quantize_rows(rms_norm(residual + x))` with `residual`
    updated in place to `residual + x` (flashinfer's fused add + RMSNorm), or the norm of x where `residual` is
    None (the stream is then x itself)."""
    m, n = x.shape
    q, s = _empty_quantized(m, n, x.device)
    block = triton.next_power_of_2(n)
    assert block <= NORM_MAX, f"hidden size {n} wider than NORM_MAX"
    if m > 0:
        assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
        r = x if residual is None else residual
        _add_rms_norm_quant_kernel[(m,)](
            x,
            r,
            weight,
            q,
            s,
            n,
            x.stride(0),
            r.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            FP8_MAX_C=FP8_MAX,
            MIN_AMAX_C=MIN_AMAX,
            num_warps=8 if block >= 4096 else 4,
        )
    return q, s, (x if residual is None else residual)


def silu_mul_quant(gate_up: torch.Tensor, one_pass: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(silu(gate) * up)` for gate_up = [gate | up] `[M, 2N]`, in one launch (`one_pass`: hold the
    row in registers; by default where it is at most SILU_ONE_PASS_MAX wide)."""
    m, n2 = gate_up.shape
    n = n2 // 2
    q, s = _empty_quantized(m, n, gate_up.device)
    if m > 0:
        assert gate_up.stride(1) == 1
        one_pass = n <= SILU_ONE_PASS_MAX if one_pass is None else one_pass
        block = triton.next_power_of_2(n) if one_pass else 2048
        _silu_mul_quant_kernel[(m,)](
            gate_up,
            q,
            s,
            n,
            gate_up.stride(0),
            ONE_PASS=one_pass,
            BLOCK=block,
            FP8_MAX_C=FP8_MAX,
            MIN_AMAX_C=MIN_AMAX,
            num_warps=16 if one_pass and block > 8192 else 8,
        )
    return q, s


def saturate(x: torch.Tensor) -> torch.Tensor:
    """`x` as e4m3 at scale 1.0, saturated at +-448 (common/engine/fp8.py's `to_fp8`), in one launch."""
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=FP8, device=x.device)
    n = x.numel()
    if n > 0:
        block = 4096
        _saturate_kernel[(triton.cdiv(n, block),)](x, y, n, BLOCK=block, FP8_MAX_C=FP8_MAX, num_warps=8)
    return y
