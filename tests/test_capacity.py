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


def test_largest_fitting_from_a_guess_finds_what_bisection_finds() -> None:
    for guess in (0, 1, 36, 37, 38, 41, 99, 500):  # near, far (bisection takes over) and out of range
        assert largest_fitting(lambda u: u <= 37, 100, guess) == 37
    assert largest_fitting(lambda u: u <= 37, 30, 90) == 30
    assert largest_fitting(lambda u: False, 100, 50) == 0


def test_largest_chunk_with_attention_is_the_largest_within_the_target() -> None:
    cost = StepCost(base_s=0.005, per_prefill_token_s=2e-5, per_decode_row_s=1.6e-5, per_attention_pair_s=1.1e-9)
    for start in (0, 1000, 30_000):
        for target in (0.02, 0.05, 0.2):
            got = cost.largest_chunk(target, 40, 120_000, start, 2048, 16)

            def step(n: int, start: int = start) -> float:
                return cost.step_s(n, 40, 120_000, chunk_attention(start, n))

            assert got % 16 == 0 and 0 <= got <= 2048
            assert got == 0 or step(got) <= target
            assert got == 2048 or step(got + 16) > target
