"""On the CPU under Triton's interpreter: the GEMV experts of decode steps (common/engine/gpu/moe_gemv.py) against
the plain experts, float32, and chosen by the token count (`DecodeExperts`); the one-kernel softmax top-k
(common/engine/gpu/moe_route.py) against `route`; and the kernels built for Hopper with Triton's ptxas. The GPU runs them at bfloat16 in tests/test_gpu_path.py."""

from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

triton = pytest.importorskip("triton")

from common.engine.gpu.moe_gemv import MAX_TOKENS  # noqa: E402  (imports Triton)


def test_gemv_experts_interpreted_match_the_plain_experts() -> None:
    result = run_interpreted("tests.moe_gemv_interpreted")
    cases = result["cases"]
    assert len(cases) == 3 * 9 + 12
    counts = (*range(1, 9), MAX_TOKENS)
    assert {(c["top_k"], c["tokens"]) for c in cases} >= {(k, t) for k in (1, 2, 8) for t in counts}
    assert all(c["shape"] == [c["tokens"], c["hidden"]] for c in cases), cases
    # Experts with no token and experts shared by several tokens both occur ...
    assert all(c["idle_experts"] > 0 for c in cases if c["tokens"] * c["top_k"] < 16), cases
    assert any(c["shared_experts"] > 0 and c["small_tiles"] for c in cases), cases
    # ... and every output is the plain experts' sum.
    assert all(c["err"] < 1e-5 for c in cases), cases
    gemv, grouped, refused = result["chooser"]
    assert gemv["tokens"] == 3 and grouped["tokens"] == 12
    assert max(gemv["err"], grouped["err"]) < 1e-5, result["chooser"]
    assert f"1..{MAX_TOKENS} tokens" in refused["refused"]
    routes = result["route"]
    assert len(routes) == 16 and all(c["ids_dtype"] == "torch.int64" and c["ids_distinct"] for c in routes), routes
    # The experts `route` takes (float32 logits; bfloat16 ones tie, and ties may go either way) with its weights.
    assert all(c["ids_equal"] for c in routes if c["logits"] == "torch.float32"), routes
    assert all(max(c["weights_err"], c["weights_of_ids_err"]) < 1e-6 for c in routes), routes


@pytest.mark.parametrize("tokens", [1, MAX_TOKENS])
def test_gemv_experts_compile_for_hopper(tokens: int) -> None:
    """The interpreter accepts constructs the compiler rejects: both kernels, at the tiles the GPU takes, built for
    compute capability 9.0 down to a cubin by Triton's own ptxas (no GPU needed)."""
    from common.engine.gpu import moe_gemv

    shared = {"M": "i32", "N": "i32", "K": "i32", "stride_we": "i32", "stride_wn": "i32", "ids_ptr": "*i64"}
    kernels = {
        moe_gemv._experts_gate_up_kernel: (
            {"x_ptr": "*bf16", "w_ptr": "*bf16", "act_ptr": "*fp32", "stride_xm": "i32"},
            moe_gemv.experts_config(tokens, 2 * 768),
        ),
        moe_gemv._experts_down_kernel: (
            {"act_ptr": "*fp32", "wts_ptr": "*fp32", "w_ptr": "*bf16", "y_ptr": "*bf16", "stride_ym": "i32"},
            moe_gemv.experts_config(tokens, 2048, moe_gemv.DOWN_MIN_PROGRAMS),
        ),
    }
    for kernel, (types, cfg) in kernels.items():
        consts = {
            "TOP_K": 8,
            "TOPK_POW2": 8,
            "USE_DOT": tokens > 1,
            "BLOCK_M": 1 if tokens == 1 else MAX_TOKENS,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "NUM_STAGES": cfg.num_stages,
        }
        _build_for_hopper(kernel, {**shared, **types}, consts, cfg.num_warps)


def test_softmax_top_k_compiles_for_hopper() -> None:
    """The routing kernel, Qwen3-30B-A3B's shape (128 experts, top-8) and a padded one, built for compute capability
    9.0 by Triton's ptxas."""
    from common.engine.gpu import moe_route

    types = {"logits_ptr": "*bf16", "w_ptr": "*fp32", "ids_ptr": "*i64", "E": "i32", "stride_t": "i32", "scale": "fp32"}
    for experts, top_k in ((128, 8), (60, 2)):
        consts = {"TOP_K": top_k, "TOPK_POW2": top_k, "E_POW2": triton.next_power_of_2(experts), "RENORMALIZE": True}
        _build_for_hopper(moe_route._softmax_top_k_kernel, types, consts, num_warps=1)


def _build_for_hopper(kernel, types: dict[str, str], consts: dict, num_warps: int) -> None:
    """`kernel` with these argument types and constants compiled for compute capability 9.0 down to a cubin
    (skipped where this Triton has no ptxas)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else types[n] for n in names}
    src = ASTSource(kernel, signature, {(names.index(n),): v for n, v in consts.items()})
    try:
        built = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except RuntimeError as e:  # no ptxas in this Triton's wheel: nothing to build with
        if "ptxas" in str(e).lower():
            pytest.skip(str(e))
        raise
    assert built.asm["cubin"], kernel
