"""Run by tests/test_gemv_interpreted.py under TRITON_INTERPRET=1 (Triton's interpreter, on the CPU): the GEMV
that adds a projection into the residual stream (its epilogue) and the GEMV that applies the next RMSNorm from
the statistics that epilogue left, alone and with the MLP's SiLU-mul as its epilogue (`gated`: the weight read as
[gate; up]), against float64; prints one JSON line.

And the whole decoder forward of a one-token decode step with those GEMVs as its ops (`GemvOps` over torch's
norm and activation), against the same forward on `TorchOps`: the stream, the statistics (`InStream`) and the
gated activation (`Activated`) carried through the layers as the model runs them.

Activations are float32 here (the interpreter computes bfloat16 operands wrongly; tests/test_gpu_kernels.py runs
bfloat16 on the GPU). Weights are float32 or e4m3 with a scale per output row; one row runs the FMA kernel, three
rows the dot kernel."""

from __future__ import annotations

import copy
import json

import torch
import torch.nn.functional as F

from common.engine.gpu.fused_gemv import GemvConfig, gemv
from common.engine.gpu.ops import GemvOps
from common.engine.layers import RotaryCache, TorchOps
from common.engine.model import DecoderModel
from common.engine.model_config import ModelConfig
from common.engine.weights import init_dummy_weights
from tests.gemv_reference import rel_err, rms_norm64, silu_mul64, weight_operand


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
                w_out, out_scale, dense_out = weight_operand(torch.randn(hidden, inner, generator=g) * inner**-0.5, fp8)
                w_next, next_scale, dense_next = weight_operand(
                    torch.randn(wide, hidden, generator=g) * hidden**-0.5, fp8
                )
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
                ref_stream = before + (silu_mul64(x) if silu else x.double()) @ dense_out.T
                ref_y = rms_norm64(ref_stream, norm_weight, eps) @ dense_next.T
                y, act = (
                    gemv(
                        stream,
                        w_next,
                        prologue="stream_norm",
                        norm_weight=norm_weight,
                        eps=eps,
                        norm_stats=sumsq,
                        weight_scale=next_scale,
                        config=cfg,
                        gated=gated,
                    )[0]
                    for gated in (False, True)
                )
                out.append(
                    {
                        "rows": rows,
                        "fp8": fp8,
                        "silu": silu,
                        "in_place": new.data_ptr() == stream.data_ptr(),
                        "parts": sumsq.shape[1],
                        "stream_err": rel_err(stream, ref_stream),
                        "sumsq_err": rel_err(sumsq.sum(1), ref_stream.pow(2).sum(1)),
                        "y_err": rel_err(y, ref_y),
                        "act_shape": list(act.shape),
                        "act_err": rel_err(act, silu_mul64(ref_y)),
                    }
                )
    return out


class TorchGemvOps(GemvOps, TorchOps):
    """The GPU path's GEMM choices over torch's norm and activation; records what `project` and the gated
    `norm_linear` handed on, so the test knows the fused path ran."""

    def __init__(self, **kw: bool) -> None:
        super().__init__(gemv_max_rows=8, **kw)
        self.handed: set[str] = set()

    def project(self, *args, **kw):  # type: ignore[no-untyped-def]
        out = super().project(*args, **kw)
        self.handed.add(type(out[0]).__name__)
        return out

    def norm_linear(self, *args, **kw):  # type: ignore[no-untyped-def]
        out = super().norm_linear(*args, **kw)
        self.handed.add(type(out[0]).__name__)
        return out


class GrowingKV:
    """Causal attention over every token this backend has seen (one sequence), keys kept per layer."""

    def __init__(self, rotary: RotaryCache) -> None:
        self.rotary = rotary
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, layer: int, positions, q, k, v):  # type: ignore[no-untyped-def]
        q, k = self.rotary.apply(positions, q, k)
        if layer in self.kv:
            k, v = torch.cat((self.kv[layer][0], k)), torch.cat((self.kv[layer][1], v))
        self.kv[layer] = (k, v)
        group = q.shape[1] // k.shape[1]
        kk, vv = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        allowed = torch.arange(k.shape[0])[None, :] <= positions[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=allowed)
        return o.transpose(0, 1)


def forward_cases() -> list[dict]:
    cfg = ModelConfig.from_hf_dict(
        dict(
            model_type="llama",
            vocab_size=96,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
    )
    out = []
    for fp8 in (False, True):
        model = DecoderModel(cfg, torch.float32, torch.device("cpu"))
        init_dummy_weights(model, seed=1)
        if fp8:
            model.quantize_linears()
        prompt, step = torch.tensor([5, 17, 42, 8, 61]), torch.tensor([33])
        attn = GrowingKV(model.rotary)
        model.ops = TorchOps()
        model.forward_tokens(prompt, torch.arange(5), attn)  # the prompt's K/V, on the torch path

        def decode(ops: TorchOps, model=model, step=step, attn=attn) -> torch.Tensor:
            model.ops = ops
            return model.forward_tokens(step, torch.tensor([5]), copy.deepcopy(attn))

        # FP8: the twin quantizes activations per token where the GEMV keeps them, so the fused paths are held
        # to the unfused GEMVs (norm and SiLU-mul kernels between them) and the twin's distance is reported.
        twin, unfused = decode(TorchOps()), decode(TorchGemvOps(stream_stats=False))
        for kw in ({}, {"gated_epilogue": False}, {"fold_prologues": True}):
            ops = TorchGemvOps(**kw)
            got = decode(ops)
            out.append(
                {
                    "fp8": fp8,
                    "ops": kw,
                    "handed": sorted(ops.handed),
                    "rel_err_vs_unfused": float((got - unfused).norm() / unfused.norm()),
                    "rel_err_vs_twin": float((got - twin).norm() / twin.norm()),
                }
            )
    return out


if __name__ == "__main__":
    print(json.dumps({"cases": cases(), "forward": forward_cases()}))
