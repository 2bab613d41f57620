"""The GPU penalty kernels (common/engine/gpu/penalty.py) run on the CPU under Triton's interpreter and give the
torch path's logits bit for bit: every combination of repetition and frequency/presence penalties, windows of
one and of several blocks, repeated ids, and the record kernel over more rows than one program takes. The same
comparison on a GPU, at the 8B's vocabulary, is in tests/test_sampling.py (it needs CUDA)."""

from __future__ import annotations

from tests.interpreter import run_interpreted


def test_penalty_kernels_interpreted_equal_the_torch_path() -> None:
    result = run_interpreted("tests.penalty_kernels_interpreted")
    cases = result["penalize"]
    assert {c["kind"] for c in cases} == {"all", "repetition only", "counts only"}
    assert any(c["width"] > 512 for c in cases)  # a window of several blocks
    assert all(c["equal"] for c in cases), cases
    assert result["record"]
