"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, each a SiLU-gated
MLP, and the token's output is their outputs weighted by the router.

`MoeExperts` holds one layer's weights, experts stacked (`w13`: every expert's [gate; up], `w2`: its down
projection), and is what the decoder calls: `forward(hidden) -> hidden`. Routing (`route`) and the experts'
GEMMs (`experts_fn`) are apart so a fused path (flashinfer's fused MoE, a grouped GEMM) can take the experts
with the same routing, by setting `experts_fn`; `grouped_experts` is the plain one the CPU runs.
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


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` float32, expert ids `[T, k]`): softmax over every expert in float32, then the top k,
    renormalised to sum to 1 when the family does (Mixtral always; Qwen3-MoE when `norm_topk_prob`)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
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
    parallelism: its output is then a partial sum, all-reduced by the caller as a dense MLP's is)."""

    def __init__(self, moe: MoeConfig, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        e, i, h = moe.num_experts, moe.intermediate_size, hidden_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.gate = param(e, h)  # the router
        self.w13 = param(e, 2 * i, h)  # each expert's [gate; up] projections
        self.w2 = param(e, h, i)  # each expert's down projection
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.experts_fn: ExpertsFn = grouped_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(F.linear(x, self.gate), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[T, H]`, the post-attention norm's output; the MLP's output, `[T, H]`."""
        weights, ids = self.route(x)
        return self.experts_fn(x, weights, ids, self.w13, self.w2)
