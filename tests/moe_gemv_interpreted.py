"""Run by tests/test_moe_gemv_interpreted.py under TRITON_INTERPRET=1 (Triton's interpreter, on the CPU): the
GEMV experts (common/engine/gpu/moe_gemv.py) against the plain experts (`grouped_experts`), float32, over
1..8 and 16 tokens (the row tile) and k = 1, 2, 8 of 16 experts (so some experts get no token and some several), even and odd
sizes, the GPU's tiles and small ones; and `DecodeExperts` choosing them or the
grouped GEMMs by the token count; the one-kernel softmax top-k routing against `route`. Prints one JSON line."""

from __future__ import annotations

import json

import torch

from common.engine.gpu.fused_gemv import GemvConfig
from common.engine.gpu.moe_experts import grouped_mm_experts
from common.engine.gpu.moe_gemv import MAX_TOKENS, DecodeExperts, gemv_experts
from common.engine.gpu.moe_route import DecodeRoute
from common.engine.model_config import MoeConfig
from common.engine.moe import grouped_experts, route

EXPERTS = 16
SMALL = GemvConfig(block_n=8, block_k=16, num_warps=4, num_stages=1)


def _layer(g: torch.Generator, tokens: int, hidden: int, inner: int, top_k: int):
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(EXPERTS, 2 * inner, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(EXPERTS, hidden, inner, generator=g) * inner**-0.5
    gating = MoeConfig(num_experts=EXPERTS, top_k=top_k, intermediate_size=inner, renormalize=top_k > 1, layers=())
    weights, ids = route(torch.randn(tokens, EXPERTS, generator=g), gating)
    return x, weights, ids, w13, w2


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def _case(g: torch.Generator, tokens: int, hidden: int, inner: int, top_k: int, tiles: GemvConfig | None) -> dict:
    x, weights, ids, w13, w2 = _layer(g, tokens, hidden, inner, top_k)
    ref = grouped_experts(x, weights, ids, w13, w2)
    got = gemv_experts(x, weights, ids, w13, w2, tiles, tiles)
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
    return {
        "hidden": hidden,
        "inner": inner,
        "top_k": top_k,
        "tokens": tokens,
        "small_tiles": tiles is not None,
        "shape": list(got.shape),
        "idle_experts": int((counts == 0).sum()),
        "shared_experts": int((counts > 1).sum()),
        "err": _err(got, ref),
    }


def cases() -> list[dict]:
    """1..8 tokens and a full row tile at k = 1, 2, 8 with the tiles the GPU takes; odd sizes (masked tails) at a few; small
    tiles (several programs over the hidden and intermediate columns, several K tiles per expert) at a few."""
    g = torch.Generator().manual_seed(0)
    out = [_case(g, t, 32, 16, k, None) for k in (1, 2, 8) for t in (*range(1, 9), MAX_TOKENS)]
    out += [_case(g, t, 45, 27, k, None) for k in (2, 8) for t in (1, 3, 8)]
    out += [_case(g, t, h, i, k, SMALL) for h, i in ((32, 32), (45, 27)) for k, t in ((8, 1), (2, 5), (8, 3))]
    return out


def chooser_cases() -> list[dict]:
    """`DecodeExperts` at 3 tokens (GEMV experts) and 12 (grouped GEMMs: torch's CPU grouped GEMM), against the
    plain experts; and the GEMV experts refusing more tokens than their row tile."""
    g = torch.Generator().manual_seed(1)
    experts = DecodeExperts(MAX_TOKENS, grouped_mm_experts)
    out = []
    for tokens in (3, 12):
        x, weights, ids, w13, w2 = _layer(g, tokens, 32, 24, 2)
        out.append(
            {
                "tokens": tokens,
                "err": _err(experts(x, weights, ids, w13, w2), grouped_experts(x, weights, ids, w13, w2)),
            }
        )
    try:
        gemv_experts(*_layer(g, MAX_TOKENS + 1, 32, 24, 2))
        refused = ""
    except ValueError as e:
        refused = str(e)
    return [*out, {"refused": refused}]


def route_cases() -> list[dict]:
    """The one-kernel softmax top-k against `route`: 1..8 tokens, k = 1, 2, 8 of 16 and of 60 experts (a padded
    row), renormalised or not, scaled or not, float32 and bfloat16 logits; and `DecodeRoute` at 12 tokens (`route`)."""
    g = torch.Generator().manual_seed(2)
    out = []
    for experts, top_k, renormalize, scale, dtype in (
        (16, 1, False, 1.0, torch.float32),
        (16, 2, True, 1.0, torch.float32),
        (60, 8, True, 2.5, torch.bfloat16),
        (60, 8, False, 1.0, torch.float32),
    ):
        moe = MoeConfig(experts, top_k, 8, renormalize, (), routed_scaling_factor=scale)
        for tokens in (1, 3, 8, 12):
            logits = (3 * torch.randn(tokens, experts, generator=g)).to(dtype)
            weights, ids = route(logits, moe)
            got_w, got_ids = DecodeRoute(8)(logits, moe)
            # Equal probabilities (bfloat16 logits) may be taken in either order: the weights of the ids taken, as
            # `route` would give them, must be those returned.
            probs = logits.float().softmax(-1).gather(1, got_ids)
            if renormalize:
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
            out.append(
                {
                    "experts": experts,
                    "top_k": top_k,
                    "tokens": tokens,
                    "logits": str(dtype),
                    "ids_equal": torch.equal(got_ids, ids),
                    "ids_distinct": all(len(set(row)) == top_k for row in got_ids.tolist()),
                    "ids_dtype": str(got_ids.dtype),
                    "weights_err": float((got_w - weights).abs().max()),
                    "weights_of_ids_err": float((got_w - probs * scale).abs().max()),
                }
            )
    return out


if __name__ == "__main__":
    print(json.dumps({"cases": cases(), "chooser": chooser_cases(), "route": route_cases()}))
