"""On the CPU under Triton's interpreter: the GEMV's residual-stream epilogue, norm-from-statistics prologue,
SiLU-mul epilogue and RoPE + K/V-write epilogue (common/engine/gpu/fused_gemv.py), one row and a few, 16-bit-style
and FP8 weights, against float64 and the unfused kernels; and a decode step of the whole decoder with them as its
ops (`GemvOps`) over the CPU's paged attention, against the unfused GEMVs and the CPU path. The GPU runs the
kernels at bfloat16 in tests/test_gpu_kernels.py."""

from __future__ import annotations

from tests.interpreter import run_interpreted


def test_gemv_stream_epilogue_and_norm_prologue_interpreted_match_float64() -> None:
    result = run_interpreted("tests.gemv_interpreted")
    cases = result["cases"]
    assert len(cases) == 8 and {c["rows"] for c in cases} == {1, 3}
    assert all(c["in_place"] and c["parts"] == 6 for c in cases), cases
    assert all(c["act_shape"] == [c["rows"], 40] for c in cases), cases  # [gate; up] of 80 rows -> 40 columns
    assert all(max(c["stream_err"], c["sumsq_err"], c["y_err"], c["act_err"]) < 1e-5 for c in cases), cases
    rope = result["rope"]
    assert len(rope) == 8 and all(c["q_shape"] == [c["rows"], 4, 16] for c in rope), rope
    # Rotated q and the pool's bytes exactly as the unfused GEMV + RoPE/K-V-write kernel leave them, each token's
    # K and V rows (and no other row) written ...
    assert all(c["q_same_as_unfused"] and c["pool_same_as_unfused"] for c in rope), rope
    assert all(c["rows_written"] == 2 * c["rows"] for c in rope), rope
    # ... and against float64 (an FP8 pool only loosely: the interpreter's rounding into e4m3, see the script).
    assert all(c["q_err"] < 1e-6 for c in rope), rope
    assert all(max(c["k_err"], c["v_err"]) < 1e-6 for c in rope if c["pool"] == "torch.float32"), rope
    assert all(max(c["k_err"], c["v_err"]) < 0.2 for c in rope), rope
    forward = result["forward"]
    assert len(forward) == 8
    # The decode step handed the stream's statistics (and, gated, the activation; with the RoPE epilogue, the
    # rotated q of every layer) from GEMV to GEMV ...
    for c in forward:
        handed = c["handed"]
        assert handed.get("InStream") == 6, c  # o and down of each of the 3 layers
        assert ("Activated" in handed) != (c["ops"] == {"gated_epilogue": False}), c
        assert handed.get("Rotated", 0) == (0 if c["ops"] == {"rope_epilogue": False} else 3), c
    # ... writes the K/V the unfused kernels write and gives their logits; float32 weights, those of the CPU path.
    assert all(c["rel_err_vs_unfused"] < 1e-5 and c["kv_err_vs_unfused"] < 1e-6 for c in forward), forward
    assert all(c["rel_err_vs_twin"] < 1e-5 for c in forward if not c["fp8"]), forward
    assert all(c["rel_err_vs_twin"] < 0.15 for c in forward if c["fp8"]), forward  # per-token e4m3 activations
