"""On the CPU under Triton's interpreter: the GEMV experts of decode steps (common/engine/gpu/moe_gemv.py) against
the plain experts, float32, and chosen by the token count (`DecodeExperts`). The GPU runs them at bfloat16 in
tests/test_gpu_path.py."""

from __future__ import annotations

from common.engine.gpu.moe_gemv import MAX_TOKENS
from tests.interpreter import run_interpreted


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
