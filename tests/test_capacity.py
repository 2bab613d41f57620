"""The capacity model (common/capacity.py): step times, prefill rates and the batch a target allows, by hand."""

from __future__ import annotations

import pytest

from common.capacity import StepCost, chunk_attention, largest_fitting, prompt_steps_s

COST = StepCost(base_s=0.004, per_prefill_token_s=25e-6, per_decode_row_s=20e-6, per_context_token_s=5e-8)


def test_step_time_adds_each_term() -> None:
    assert COST.step_s(512, 10, 10_000) == pytest.approx(0.004 + 512 * 25e-6 + 10 * 20e-6 + 10_000 * 5e-8)


def test_prefill_rate_is_chunk_over_its_step() -> None:
    assert COST.prefill_rate(1000) == pytest.approx(1000 / (0.004 + 0.025))
    assert StepCost().prefill_rate(1000) == 0.0  # nothing measured: no rate


def test_largest_chunk_stays_within_the_target() -> None:
    # 0.05 s target beside 10 rows of 1,000 tokens: (0.05 - 0.004 - 0.0002 - 0.0005) / 25e-6 = 1812 -> 1792 (x256)
    assert COST.largest_chunk(0.05, 10, 10_000, 0, 8192, 256) == 1792
    assert COST.largest_chunk(0.001, 10, 10_000, 0, 8192, 256) == 0


def test_decode_rows_within_a_step_target() -> None:
    # rows r at 1,000 tokens each: 0.004 + r * (20e-6 + 5e-5) <= 0.011  ->  r <= 100
    assert COST.decode_rows_within(0.011, 1000, 256) == 100
    assert COST.decode_rows_within(0.011, 1000, 64) == 64


def test_a_prompt_alone_runs_its_chunks_back_to_back() -> None:
    cost = StepCost(base_s=0.01, per_prefill_token_s=1e-4, per_attention_pair_s=1e-8)
    assert prompt_steps_s(cost, 3000, 1024) == pytest.approx(3 * 0.01 + 0.3 + 1e-8 * 3000 * 3000 / 2)
    assert chunk_attention(1024, 512) == 512 * (1024 + 256)


def test_largest_fitting_bisects() -> None:
    assert largest_fitting(lambda u: u <= 37, 100) == 37
    assert largest_fitting(lambda u: False, 100) == 0
