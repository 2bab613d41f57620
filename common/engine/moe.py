"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, DeepSeek-V2/V3): a router picks each token's top-k experts, each
a SiLU-gated MLP, and the token's output is their outputs weighted by the router, plus DeepSeek's shared expert.

`MoeExperts` holds one layer's weights, experts stacked (`w13`: every expert's [gate; up], `w2`: its down
projection), and is what the decoder calls: `forward(hidden) -> hidden`. Routing (`route`) and the experts'
GEMMs (`experts_fn`) are apart so a fused path (flashinfer's fused MoE, a grouped GEMM) can take the experts
with the same routing, by setting `experts_fn`; `grouped_experts` is the plain one the CPU runs. `route_fn`
likewise lets a fused kernel compute the same routing from the router's logits.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.layers import silu_and_mul
from common.engine.model_config import MoeConfig


class ExpertsFn(Protocol):
    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        """sum over k of weights[t, k] * expert ids[t, k] (x[t]), `[T, H]` in x's dtype."""


class RouteFn(Protocol):
    def __call__(
        self, logits: torch.Tensor, moe: MoeConfig, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights `[T, k]` float32, expert ids `[T, k]`) from the router's logits `[T, E]`, as `route`."""


def route(logits: torch.Tensor, moe: MoeConfig, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` float32, expert ids `[T, k]`) by the family's gating (`MoeConfig`): softmax or sigmoid
    scores in float32; the top k of them, from the best `topk_group` expert groups where the method limits the
    choice by group, chosen by score + `bias` (DeepSeek-V3's correction bias) but weighted by the score alone;
    renormalised to sum to 1 when the family does, then scaled by `routed_scaling_factor`."""
    logits = logits.float()
    scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if moe.n_group > 1:
        grouped = choice.view(choice.shape[0], moe.n_group, -1)
        if moe.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:  # group_limited_greedy: a group counts by its best expert
            group_scores = grouped.amax(dim=-1)
        best = group_scores.topk(moe.topk_group, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
    ids = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids


def grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The experts by groups: every (token, choice) pair sorted by expert, each expert's tokens gathered and run
    as one GEMM pair, the weighted outputs added back to their tokens. One loop over the experts, none over
    tokens; the counts come to the host (a sync the CPU does not mind, and which a fused path avoids)."""
    num_experts, top_k = w13.shape[0], ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # pairs grouped by expert, in token order within each expert
    token = order // top_k  # the token of each sorted pair
    xs = x.index_select(0, token)
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if n:
            rows = slice(start, start + n)
            ys[rows] = F.linear(silu_and_mul(F.linear(xs[rows], w13[e])), w2[e])
            start += n
    ys = ys * weights.flatten().index_select(0, order).unsqueeze(1).to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, token, ys)


class MoeExperts(nn.Module):
    """One layer's router and experts (this rank's slice of every expert's intermediate dim under tensor
    parallelism: its output is then a partial sum, all-reduced by the caller as a dense MLP's is), and the
    shared expert where the family has one (`shared_w13`, `shared_w2`: one SiLU-gated MLP every token runs)."""

    def __init__(self, moe: MoeConfig, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        e, i, h = moe.num_experts, moe.intermediate_size, hidden_size

        def param(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)

        self.gate = param(e, h, dt=torch.float32 if moe.float32_router else dtype)  # the router
        self.correction_bias = param(e, dt=torch.float32) if moe.correction_bias else None
        self.w13 = param(e, 2 * i, h)  # each expert's [gate; up] projections
        self.w2 = param(e, h, i)  # each expert's down projection
        s = moe.shared_intermediate_size
        self.shared_w13 = param(2 * s, h) if s else None
        self.shared_w2 = param(h, s) if s else None
        self.config = moe
        self.experts_fn: ExpertsFn = grouped_experts
        self.route_fn: RouteFn = route

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_fn(F.linear(x.to(self.gate.dtype), self.gate), self.config, self.correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[T, H]`, the post-attention norm's output; the MLP's output, `[T, H]`."""
        weights, ids = self.route(x)
        out = self.experts_fn(x, weights, ids, self.w13, self.w2)
        if self.shared_w13 is not None and self.shared_w2 is not None:
            out = out + F.linear(silu_and_mul(F.linear(x, self.shared_w13)), self.shared_w2)
        return out
