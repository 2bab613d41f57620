"""The split-KV decode attention kernel (common/engine/gpu/decode_attention.py) on the CPU under Triton's
interpreter: 16-bit-style and FP8 pages with their K/V scales, one split (the direct store, no merge) and
several (the merge), against float64 attention. The GPU runs the same at bfloat16 in tests/test_gpu_kernels.py."""

from __future__ import annotations

from tests.interpreter import run_interpreted


def test_decode_attention_interpreted_matches_float64() -> None:
    cases = run_interpreted("tests.decode_attention_interpreted")["cases"]
    assert {c["pages"] for c in cases} == {"torch.float32", "torch.float8_e4m3fn"}
    assert {c["splits"] for c in cases} == {1, 3}
    assert all(c["rel_err"] < 1e-5 for c in cases), cases
