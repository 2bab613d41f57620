"""Penalties on the GPU in two launches a step (applying them at each row's history ids; recording the sampled
tokens) in place of ~18 small torch ops. Same float32 arithmetic in the same order, IEEE division and no FMA,
so the logits equal the torch path's bit for bit. A row's repeated ids all compute from the one original
logit: values go to a scratch row first, written back after a barrier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 512
_RECORD_BLOCK = 128  # fixed: a block sized to the batch would compile a kernel per power of two while serving


# Integer arguments are not specialized on their values: one compiled kernel, whatever the batch.
@triton.jit(
    do_not_specialize=[
        "logits_stride", "ids_stride", "counts_stride", "rep_stride", "freq_stride", "pres_stride", "width",
        "repetition", "counted",
    ]
)  # fmt: skip
def _penalize_kernel(
    logits_ptr,
    logits_stride,
    ids_ptr,
    ids_stride,
    counts_ptr,
    counts_stride,
    rows_ptr,
    rep_ptr,
    rep_stride,
    freq_ptr,
    freq_stride,
    pres_ptr,
    pres_stride,
    scratch_ptr,
    width,
    repetition,
    counted,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    logits_row = logits_ptr + b * logits_stride
    ids_row = ids_ptr + row * ids_stride
    scratch_row = scratch_ptr + b * width
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < width
        ids = tl.load(ids_row + offs, mask=inside, other=0)
        value = tl.load(logits_row + ids, mask=inside, other=0.0)
        if repetition:
            p = tl.load(rep_ptr + b * rep_stride)
            value = tl.where(value > 0, tl.math.div_rn(value, p), value * p)
        if counted:
            f = tl.load(freq_ptr + b * freq_stride)
            pres = tl.load(pres_ptr + b * pres_stride)
            c = tl.load(counts_ptr + row * counts_stride + ids, mask=inside, other=0.0)
            value = value - f * c
            value = value - pres * (c > 0).to(tl.float32)
        tl.store(scratch_row + offs, value, mask=inside)
    tl.debug_barrier()
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < width
        ids = tl.load(ids_row + offs, mask=inside, other=0)
        value = tl.load(scratch_row + offs, mask=inside)
        tl.store(logits_row + ids, value, mask=inside)


@triton.jit(do_not_specialize=["ids_stride", "counts_stride", "n"])
def _record_kernel(
    ids_ptr,
    ids_stride,
    counts_ptr,
    counts_stride,
    rows_ptr,
    start_ptr,
    steps_ptr,
    tokens_ptr,
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    row = tl.load(rows_ptr + offs, mask=inside, other=0).to(tl.int64)
    pos = tl.load(start_ptr + offs, mask=inside, other=0) + tl.load(steps_ptr + offs, mask=inside, other=0)
    token = tl.load(tokens_ptr + offs, mask=inside, other=0)
    tl.store(ids_ptr + row * ids_stride + pos, token, mask=inside)
    # A batch's rows are distinct: no two lanes touch one count.
    at = counts_ptr + row * counts_stride + token
    tl.store(at, tl.load(at, mask=inside, other=0.0) + 1.0, mask=inside)


def penalize(
    logits: torch.Tensor,
    ids: torch.Tensor,
    counts: torch.Tensor | None,
    rows: torch.Tensor,
    width: int,
    repetition: torch.Tensor | None,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """Applies the penalties to `logits` [B, V] float32 in place at `ids[rows[b], :width]`, with output counts
    `counts[rows[b], id]` (None: frequency and presence off) and `repetition` (None: off)."""
    batch = logits.shape[0]
    if batch == 0 or width == 0:
        return
    scratch = torch.empty((batch, width), dtype=torch.float32, device=logits.device)
    counted = counts is not None
    _penalize_kernel[(batch,)](
        logits,
        logits.stride(0),
        ids,
        ids.stride(0),
        counts if counted else logits,
        counts.stride(0) if counted else 0,
        rows,
        repetition if repetition is not None else frequency,
        repetition.stride(0) if repetition is not None else 0,
        frequency,
        frequency.stride(0),
        presence,
        presence.stride(0),
        scratch,
        width,
        int(repetition is not None),
        int(counted),
        BLOCK=_BLOCK,
        num_warps=4,
        enable_fp_fusion=False,
    )


def record(
    ids: torch.Tensor,
    counts: torch.Tensor,
    rows: torch.Tensor,
    start: torch.Tensor,
    steps: torch.Tensor,
    tokens: torch.Tensor,
) -> None:
    """`ids[rows[b], start[b] + steps[b]] = tokens[b]` and `counts[rows[b], tokens[b]] += 1` (rows distinct)."""
    n = tokens.shape[0]
    if n == 0:
        return
    _record_kernel[(triton.cdiv(n, _RECORD_BLOCK),)](
        ids, ids.stride(0), counts, counts.stride(0), rows, start, steps, tokens, n, BLOCK=_RECORD_BLOCK, num_warps=4
    )
