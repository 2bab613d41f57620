"""Small GPU kernels on the CPU under Triton's interpreter (tests/small_kernels_interpreted.py): greedy sampling's
two-launch argmax (common/engine/gpu/argmax.py) against torch's argmax, and XQA's dense page table
(common/engine/gpu/xqa_pages.py) against each row's pages. tests/test_gpu_kernels.py runs both on the GPU."""

from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_interpreted("tests.small_kernels_interpreted")


def test_two_launch_argmax_matches_torch(interpreted: dict) -> None:
    *rows, nan = interpreted["argmax"]
    assert len(rows) == 4 and all(c["dtype"] == "int64" for c in rows), rows
    assert all(c["same"] and c["bf16_same"] for c in rows), rows
    assert nan["nan_row"] == nan["nan_id"], nan


def test_xqa_dense_pages_hold_each_rows_pages_and_length_with_padding_rows(interpreted: dict) -> None:
    c = interpreted["dense_pages"]
    assert c["shape"] == [7, 8] and c["dtypes"] == ["torch.int32", "torch.int32"], c
    assert c["lens"] == c["want_lens"] and c["rows_match"], c
    assert c["padding_pages"] == [c["dummy"], c["dummy"]], c
