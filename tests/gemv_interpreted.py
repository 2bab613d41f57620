"""Run by tests/test_gemv_interpreted.py under TRITON_INTERPRET=1 (Triton's interpreter, on the CPU): the GEMV
that adds a projection into the residual stream (its epilogue) and the GEMV that applies the next RMSNorm from
the statistics that epilogue left, alone and with the MLP's SiLU-mul as its epilogue (`gated`: the weight read as
[gate; up]), against float64; prints one JSON line.

Activations are float32 here (the interpreter computes bfloat16 operands wrongly; tests/test_gpu_kernels.py runs
bfloat16 on the GPU). Weights are float32 or e4m3 with a scale per output row; one row runs the FMA kernel, three
rows the dot kernel."""

from __future__ import annotations

import json

import torch

from common.engine.fp8 import quantize_rows
from common.engine.gpu.fused_gemv import GemvConfig, gemv


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def cases() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    hidden, inner, wide, eps = 96, 64, 80, 1e-5
    # Small tiles so the stream spans several programs (several partial sums per row).
    cfg = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=1)
    out = []
    for rows in (1, 3):
        for fp8 in (False, True):
            for silu in (False, True):
                x = torch.randn(rows, 2 * inner if silu else inner, generator=g)
                w_out = torch.randn(hidden, inner, generator=g) * inner**-0.5
                w_next = torch.randn(wide, hidden, generator=g) * hidden**-0.5
                out_scale = next_scale = None
                if fp8:
                    (w_out, out_scale), (w_next, next_scale) = quantize_rows(w_out), quantize_rows(w_next)
                    out_scale, next_scale = out_scale.flatten(), next_scale.flatten()
                dense_out = w_out.double() * (out_scale.double()[:, None] if fp8 else 1.0)
                dense_next = w_next.double() * (next_scale.double()[:, None] if fp8 else 1.0)
                stream = torch.randn(rows, hidden, generator=g)
                before = stream.double()
                norm_weight = 1.0 + 0.2 * torch.randn(hidden, generator=g)
                new, sumsq = gemv(
                    x,
                    w_out,
                    prologue="silu" if silu else "none",
                    weight_scale=out_scale,
                    into_stream=stream,
                    config=cfg,
                )
                xd = x.double()
                if silu:
                    gate, up = xd[:, :inner], xd[:, inner:]
                    xd = gate * torch.sigmoid(gate) * up
                ref_stream = before + xd @ dense_out.T
                s = ref_stream
                normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
                y, _ = gemv(
                    stream,
                    w_next,
                    prologue="stream_norm",
                    norm_weight=norm_weight,
                    eps=eps,
                    norm_stats=sumsq,
                    weight_scale=next_scale,
                    config=cfg,
                )
                act, _ = gemv(
                    stream,
                    w_next,
                    prologue="stream_norm",
                    norm_weight=norm_weight,
                    eps=eps,
                    norm_stats=sumsq,
                    weight_scale=next_scale,
                    config=cfg,
                    gated=True,
                )
                gate, up = (normed @ dense_next.T).chunk(2, dim=-1)
                out.append(
                    {
                        "rows": rows,
                        "fp8": fp8,
                        "silu": silu,
                        "in_place": new.data_ptr() == stream.data_ptr(),
                        "parts": sumsq.shape[1],
                        "stream_err": _rel(stream, ref_stream),
                        "sumsq_err": _rel(sumsq.sum(1), ref_stream.pow(2).sum(1)),
                        "y_err": _rel(y, normed @ dense_next.T),
                        "act_shape": list(act.shape),
                        "act_err": _rel(act, gate * torch.sigmoid(gate) * up),
                    }
                )
    return out


if __name__ == "__main__":
    print(json.dumps({"cases": cases()}))
