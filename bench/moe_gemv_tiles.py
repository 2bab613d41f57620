"""The MoE experts of decode steps one layer at a time: the GEMV experts (common/engine/gpu/moe_gemv.py) over a
sweep of tiles against the grouped GEMMs (common/engine/gpu/moe_experts.py) and the copy ceiling.

    python bench/moe_gemv_tiles.py --out OUT.json

Qwen3-30B-A3B's expert shapes (128 experts, hidden 2048, intermediate 768, top-8, bf16) at 1/2/4/8 tokens: each
path timed as one call on each of 16 layers' weights (2.4 GB of experts, far past L2) inside one CUDA graph, with
each layer's own random routing. Reported per point: time per layer, the routed experts' bytes over that time,
its ratio to the copy ceiling measured in this run. Every GEMV result is checked against the grouped GEMMs first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.gpu.fused_gemv import GemvConfig  # noqa: E402
from common.engine.gpu.moe_experts import grouped_mm_experts  # noqa: E402
from common.engine.gpu.moe_gemv import DOWN_MIN_PROGRAMS, experts_config, gemv_experts  # noqa: E402

EXPERTS, HIDDEN, INNER, TOP_K, LAYERS = 128, 2048, 768, 8, 16
# (gate_up tiles, down tiles): None = experts_config's.
SWEEP: list[tuple[GemvConfig | None, GemvConfig | None]] = [
    (None, None),
    (None, GemvConfig(8, 512, 4, 3)),
    (None, GemvConfig(8, 256, 4, 3)),
    (None, GemvConfig(8, 1024, 8, 2)),
    (GemvConfig(16, 256, 4, 3), None),
    (GemvConfig(8, 1024, 4, 3), GemvConfig(16, 256, 4, 3)),
]


def graph_ms(fn, iters: int = 20) -> float:
    """Median time of one replay of a CUDA graph holding `fn()` (after a warm-up call)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_ceiling() -> float:
    """Bytes per second a device-to-device copy moves (read + write)."""
    n = 1 << 30
    src = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * n / (graph_ms(lambda: dst.copy_(src)) * 1e-3)


def at_tokens(tokens: int, w13: list[torch.Tensor], w2: list[torch.Tensor], copy_bw: float) -> list[dict]:
    """The grouped GEMMs and each tile pair of the sweep at `tokens` tokens, every layer with its own routing."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    routes = []
    for _ in range(LAYERS):
        weights, ids = torch.rand(tokens, EXPERTS, generator=g, device="cuda").softmax(-1).topk(TOP_K, dim=-1)
        routes.append((weights / weights.sum(-1, keepdim=True), ids))
    touched = sum(ids.unique().numel() for _, ids in routes) / LAYERS
    layer_bytes = touched * 3 * INNER * HIDDEN * 2
    points = []

    def point(label: str, ms: float, **kw) -> None:
        per_layer = ms / LAYERS
        r = dict(tokens=tokens, path=label, us_per_layer=per_layer * 1e3, experts_touched=touched, **kw)
        r["ratio_to_copy"] = layer_bytes / (per_layer * 1e-3) / copy_bw
        points.append(r)
        print(json.dumps(r), flush=True)

    def every_layer(fn, *cfg) -> None:
        for layer, (weights, ids) in enumerate(routes):
            fn(x, weights, ids, w13[layer], w2[layer], *cfg)

    point("grouped_mm", graph_ms(lambda: every_layer(grouped_mm_experts)))
    ref = grouped_mm_experts(x, *routes[0], w13[0], w2[0]).float()
    for cfg in SWEEP:
        got = gemv_experts(x, *routes[0], w13[0], w2[0], *cfg).float()
        point(
            "gemv",
            graph_ms(lambda cfg=cfg: every_layer(gemv_experts, *cfg)),
            gate_up=(cfg[0] or experts_config(tokens, 2 * INNER)).__dict__,
            down=(cfg[1] or experts_config(tokens, HIDDEN, DOWN_MIN_PROGRAMS)).__dict__,
            rel_err_vs_grouped=float((got - ref).norm() / ref.norm()),
        )
    return points


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    copy_bw = copy_ceiling()
    w13 = [torch.empty(EXPERTS, 2 * INNER, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    w2 = [torch.empty(EXPERTS, HIDDEN, INNER, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    for w in (*w13, *w2):
        w.normal_(0, 0.02)
    out = dict(device=torch.cuda.get_device_name(), copy_bytes_per_s=copy_bw, points=[])
    for tokens in (1, 2, 4, 8):
        out["points"] += at_tokens(tokens, w13, w2, copy_bw)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
