"""Run by tests/test_gemv_interpreted.py under TRITON_INTERPRET=1 (Triton's interpreter, on the CPU): the GEMV
that adds a projection into the residual stream (its epilogue) and the GEMV that applies the next RMSNorm from
the statistics that epilogue left, alone and with the MLP's SiLU-mul as its epilogue (`gated`: the weight read as
[gate; up]), against float64; the qkv GEMV that applies RoPE and writes K and V into pool rows in its epilogue
(`kv_write`), against the unfused GEMV + RoPE/K-V-write kernel and float64; prints one JSON line.

And the whole decoder forward of a one-token decode step with those GEMVs as its ops (`GemvOps` over torch's
norm and activation) and the CPU's paged attention, against the same forward on `TorchOps`: the stream, the
statistics (`InStream`), the gated activation (`Activated`) and the rotated queries (`Rotated`, K/V already in the
pool) carried through the layers as the model runs them.

Activations are float32 here (the interpreter computes bfloat16 operands wrongly, and rounds into e4m3 wrongly
where rounding carries into the exponent: 0.4993 becomes 0.25; tests/test_gpu_kernels.py runs bfloat16 and FP8
pools on the GPU against torch). Weights are float32 or e4m3 with a scale per output row; one row runs the FMA kernel, three
rows the dot kernel."""

from __future__ import annotations

import json
from collections import Counter

import torch

from common.engine.attention import TorchPagedAttention
from common.engine.forward_batch import ForwardBatch
from common.engine.fp8 import as_stored
from common.engine.gpu.fused_gemv import GemvConfig, gemv
from common.engine.gpu.ops import GemvOps
from common.engine.gpu.rope_store import rope_store
from common.engine.layers import KvWrite, RotaryCache, TorchOps
from common.engine.model import DecoderModel
from common.engine.model_config import ModelConfig, RopeConfig
from common.engine.weights import init_dummy_weights
from common.kv.pool import KVLayout, KVPool
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


def rope_cases() -> list[dict]:
    """The qkv GEMV that rotates q and k and writes K and V into pool rows itself (`kv_write`), against the unfused
    GEMV + RoPE/K-V-write kernel (bit for bit: the same float32 arithmetic) and against float64."""
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, hidden = 4, 2, 16, 48
    n = (hq + 2 * hkv) * d
    rotary = RotaryCache.build(d, RopeConfig(), 32, torch.device("cpu"))
    cfg = GemvConfig(block_n=8, block_k=16, num_warps=4, num_stages=1)  # 2 programs per head
    out = []
    for rows in (1, 3):
        for fp8 in (False, True):
            for pool_dtype in (torch.float32, torch.float8_e4m3fn):
                x = torch.randn(rows, hidden, generator=g)
                w, scale, dense = weight_operand(torch.randn(n, hidden, generator=g) * hidden**-0.5, fp8)
                bias = 0.1 * torch.randn(n, generator=g)
                positions = torch.randperm(32, generator=g)[:rows]
                out_rows = torch.tensor([5, 9, 20][:rows])
                scales = (0.5, 2.0) if pool_dtype != torch.float32 else (1.0, 1.0)

                def write(pool: torch.Tensor) -> KvWrite:
                    return KvWrite(positions, rotary.cos_sin(), pool, out_rows, 2, 30, *scales)  # noqa: B023

                fused_pool = torch.zeros(64, hkv, d, dtype=pool_dtype)
                q = gemv(x, w, bias, weight_scale=scale, config=cfg, kv_write=write(fused_pool))[0]
                qkv = gemv(x, w, bias, weight_scale=scale, config=cfg)[0]
                qq, kk, vv = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
                unfused_pool = torch.zeros(64, hkv, d, dtype=pool_dtype)
                q_ref = rope_store(
                    positions,
                    qq.view(rows, hq, d),
                    kk.view(rows, hkv, d),
                    vv.view(rows, hkv, d),
                    rotary.cos_sin(),
                    unfused_pool,
                    out_rows,
                    2,
                    30,
                    k_scale=scales[0],
                    v_scale=scales[1],
                )
                y64 = (x.double() @ dense.T + bias.double()).view(rows, -1, d)
                r64 = RotaryCache(rotary.cos.double(), rotary.sin.double())
                q64, k64 = r64.apply(positions, y64[:, :hq], y64[:, hq : hq + hkv])
                k_got = fused_pool[out_rows + 2].double() * scales[0]
                v_got = fused_pool[out_rows + 30].double() * scales[1]
                # What the pool should hold: the float64 values as the pool stores them (FP8: value / scale, rounded).
                k64 = as_stored(k64.float(), pool_dtype, scales[0]).double() * scales[0]
                v64 = as_stored(y64[:, hq + hkv :].float(), pool_dtype, scales[1]).double() * scales[1]
                out.append(
                    {
                        "rows": rows,
                        "fp8": fp8,
                        "pool": str(pool_dtype),
                        "q_shape": list(q.shape),
                        "q_same_as_unfused": torch.equal(q, q_ref),
                        "pool_same_as_unfused": torch.equal(
                            fused_pool.view(torch.uint8), unfused_pool.view(torch.uint8)
                        ),
                        "rows_written": int((fused_pool.view(torch.uint8) != 0).any(-1).any(-1).sum()),
                        "q_err": rel_err(q, q64),
                        "k_err": rel_err(k_got, k64),
                        "v_err": rel_err(v_got, v64),
                    }
                )
    return out


class TorchGemvOps(GemvOps, TorchOps):
    """The GPU path's GEMM choices over torch's norm and activation; counts what `project` and `norm_linear`
    handed on (by type), so the test knows the fused paths ran, layer by layer."""

    def __init__(self, **kw: bool) -> None:
        super().__init__(gemv_max_rows=8, **kw)
        self.handed: Counter[str] = Counter()

    def project(self, *args, **kw):  # type: ignore[no-untyped-def]
        out = super().project(*args, **kw)
        self.handed[type(out[0]).__name__] += 1
        return out

    def norm_linear(self, *args, **kw):  # type: ignore[no-untyped-def]
        out = super().norm_linear(*args, **kw)
        self.handed[type(out[0]).__name__] += 1
        return out


class OneSequence:
    """The CPU's paged attention (`TorchPagedAttention`) over a small pool holding one sequence at slots 0, 1, ..."""

    def __init__(self, model: DecoderModel, page_size: int = 4, pages: int = 4) -> None:
        cfg = model.cfg
        layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, torch.float32)
        self.pool = KVPool(layout, pages)
        table = torch.arange(pages * page_size, dtype=torch.int32)[None]
        self.attn = TorchPagedAttention(self.pool, table, cfg.num_heads, cfg.head_dim, model.rotary)

    def step(self, model: DecoderModel, ids: list[int], start: int) -> torch.Tensor:
        n = len(ids)
        positions = torch.arange(start, start + n)
        batch = ForwardBatch(
            is_decode=n == 1,
            input_ids=torch.tensor(ids),
            positions=positions,
            out_loc=positions,
            seq_lens=torch.tensor([start + n]),
            extend_lens=torch.tensor([n]),
            q_start=torch.tensor([0]),
            table_rows=torch.tensor([0]),
            logits_indices=torch.tensor([n - 1]),
            seq_lens_cpu=[start + n],
            extend_lens_cpu=[n],
        )
        self.attn.plan(batch)
        return model(batch, self.attn)


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
        kv = OneSequence(model)
        model.ops = TorchOps()
        kv.step(model, [5, 17, 42, 8, 61], 0)  # the prompt's K/V, on the torch path
        step_rows = kv.pool.token_rows(torch.tensor([5]))[:, None] + torch.arange(2 * cfg.num_layers) * 4

        def decode(ops: TorchOps, model=model, kv=kv, step_rows=step_rows) -> tuple[torch.Tensor, torch.Tensor]:
            kv.pool.rows[step_rows] = 0.0  # each run writes the decode token's K/V afresh
            model.ops = ops
            return kv.step(model, [33], 5), kv.pool.rows[step_rows].clone()

        # FP8: the twin quantizes activations per token where the GEMV keeps them, so the fused paths are held
        # to the unfused GEMVs (norm, SiLU-mul and RoPE + K/V-write kernels between them) and the twin's distance
        # is reported.
        (twin, _), (unfused, unfused_kv) = (
            decode(TorchOps()),
            decode(TorchGemvOps(stream_stats=False, rope_epilogue=False)),
        )
        for kw in ({}, {"gated_epilogue": False}, {"rope_epilogue": False}, {"fold_prologues": True}):
            ops = TorchGemvOps(**kw)
            got, got_kv = decode(ops)
            out.append(
                {
                    "fp8": fp8,
                    "ops": kw,
                    "handed": dict(ops.handed),
                    "rel_err_vs_unfused": float((got - unfused).norm() / unfused.norm()),
                    "kv_err_vs_unfused": rel_err(got_kv, unfused_kv.double()),
                    "rel_err_vs_twin": float((got - twin).norm() / twin.norm()),
                }
            )
    return out


if __name__ == "__main__":
    print(json.dumps({"cases": cases(), "rope": rope_cases(), "forward": forward_cases()}))
