"""Softmax top-k routing (Qwen3-MoE, Mixtral: `common.engine.moe.route` without groups or a correction bias) as
one Triton kernel for the few tokens of a decode step.

`route` is a softmax, a top-k, a gather and the renormalisation's sum and division: six small kernels a layer
whose launches, at one token, cost more than the experts' weight reads they lead to. Here one program per token
holds its row of logits in registers: float32 softmax, then k rounds of taking the largest probability left
(the lowest expert id among equals), renormalised and scaled as `route` does; ids and weights stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.engine.model_config import MoeConfig
from common.engine.moe import route

__all__ = ["DecodeRoute", "softmax_top_k", "softmax_top_k_fits"]


def softmax_top_k_fits(moe: MoeConfig) -> bool:
    """Whether the routing is the plain softmax top-k this kernel computes."""
    return moe.scoring == "softmax" and moe.n_group <= 1 and not moe.correction_bias


@triton.jit
def _softmax_top_k_kernel(
    logits_ptr,
    w_ptr,
    ids_ptr,
    E,
    stride_t,
    scale,
    TOP_K: tl.constexpr,
    TOPK_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0)
    re = tl.arange(0, E_POW2)
    ok = re < E
    s = tl.load(logits_ptr + t * stride_t + re, mask=ok, other=-float("inf")).to(tl.float32)
    p = tl.exp(s - tl.max(s, axis=0))
    p = p / tl.sum(p, axis=0)
    left = tl.where(ok, p, -1.0)  # probabilities are >= 0: a padding lane is never the largest
    rj = tl.arange(0, TOPK_POW2)
    weights = tl.zeros([TOPK_POW2], dtype=tl.float32)
    ids = tl.zeros([TOPK_POW2], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, re, E_POW2), axis=0)
        weights = tl.where(rj == j, best, weights)
        ids = tl.where(rj == j, idx.to(tl.int64), ids)
        left = tl.where(re == idx, -2.0, left)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(w_ptr + t * TOP_K + rj, weights * scale, mask=rj < TOP_K)
    tl.store(ids_ptr + t * TOP_K + rj, ids, mask=rj < TOP_K)


def softmax_top_k(logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`route(logits, moe)` for a softmax top-k `moe` (`softmax_top_k_fits`): (weights `[T, k]` float32, ids
    `[T, k]` int64)."""
    tokens, experts = logits.shape
    if not softmax_top_k_fits(moe) or experts != moe.num_experts or logits.stride(-1) != 1:
        raise ValueError("softmax_top_k takes unit-stride [T, E] logits of a softmax top-k routing without groups")
    weights = torch.empty(tokens, moe.top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, moe.top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _softmax_top_k_kernel[(tokens,)](
            logits,
            weights,
            ids,
            experts,
            logits.stride(0),
            moe.routed_scaling_factor,
            TOP_K=moe.top_k,
            TOPK_POW2=triton.next_power_of_2(moe.top_k),
            E_POW2=triton.next_power_of_2(experts),
            RENORMALIZE=moe.renormalize,
            num_warps=1 if experts <= 256 else 4,
        )
    return weights, ids


@dataclass(frozen=True)
class DecodeRoute:
    """`common.engine.moe.RouteFn` chosen by the step's token count: the one-kernel softmax top-k up to
    `max_tokens` tokens, `route` beyond (a shape is all it reads, so a captured graph holds one path)."""

    max_tokens: int

    def __call__(
        self, logits: torch.Tensor, moe: MoeConfig, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if bias is None and 0 < logits.shape[0] <= self.max_tokens:
            return softmax_top_k(logits, moe)
        return route(logits, moe, bias)
