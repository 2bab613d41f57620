"""The experts of a mixture-of-experts layer on the GPU with no host sync: two grouped GEMMs over the
(token, choice) pairs sorted by expert, so the step keeps CUDA graphs and the overlap loop.

The plain path (common/engine/moe.py `grouped_experts`) brings the per-expert counts to the host to slice its
loop; here the counts stay on the device as the grouped GEMM's group offsets (`torch._grouped_mm`, CUTLASS on
compute capability 9.0+), an empty group costs no weight reads, so a decode step reads only its routed experts.
"""

from __future__ import annotations

import torch

from common.engine.layers import silu_and_mul

__all__ = ["grouped_mm_experts", "grouped_mm_unsupported"]


def grouped_mm_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the grouped-GEMM experts cannot run here (None: they can)."""
    if device.type != "cuda":
        return "the grouped-GEMM experts run on CUDA devices"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no grouped GEMM"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "the grouped-GEMM experts need compute capability 9.0 or newer"
    if dtype != torch.bfloat16:
        return f"the grouped-GEMM experts run in bfloat16, not {dtype}"
    return None


def grouped_mm_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """`common.engine.moe.ExpertsFn` on the device: x `[T, H]`, weights/ids `[T, k]`, w13 `[E, 2I, H]`,
    w2 `[E, H, I]` -> `[T, H]`."""
    num_experts, top_k = w13.shape[0], ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    token = order // top_k
    # bincount sizes its output from the data (a sync); a scatter into E counters does not.
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = counts.cumsum(0, dtype=torch.int32)
    xs = x.index_select(0, token)
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
    ys = torch._grouped_mm(silu_and_mul(gate_up), w2.transpose(1, 2), offs=ends)
    # Back in (token, choice) order, then each token's k outputs weighted and summed by one batched GEMM: it
    # accumulates in float32 and in a fixed order (an index_add would add in whatever order its atomics land).
    by_token = torch.empty_like(ys).index_copy_(0, order, ys).view(-1, top_k, ys.shape[1])
    return torch.bmm(weights.unsqueeze(1).to(ys.dtype), by_token).squeeze(1)
