"""The split-KV latent-attention decode kernel (common/engine/gpu/mla_decode.py) on the CPU under Triton's
interpreter (tests/mla_decode_interpreted.py): batches 1, 3 and 8 of ragged lengths (partial last pages, requests
shorter than one split), one, two and five splits (the direct store; the log-sum-exp merge, empty splits
included), 4 heads and 18 (two head blocks), against float64 absorbed attention. tests/test_gpu_kernels.py runs
it at bfloat16 against flashinfer's MLA kernel."""

from __future__ import annotations

from tests.interpreter import run_interpreted


def test_mla_split_decode_interpreted_matches_float64() -> None:
    cases = run_interpreted("tests.mla_decode_interpreted")["cases"]
    assert {c["batch"] for c in cases} == {1, 3, 8}
    assert {c["splits"] for c in cases} == {1, 2, 5}
    assert {c["heads"] for c in cases} == {4, 18}
    assert all(c["finite"] and c["into_out"] for c in cases), cases
    assert all(c["rel_err"] < 1e-5 for c in cases), cases
