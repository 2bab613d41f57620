"""The simulated engine loop on a GPU (bench/fleet_sim/worker.py `launch_ahead`, `notice_after_step`): each step is
planned when the one before it starts, so work reaching a busy worker joins a step later than at the next boundary,
and on a shared GPU a prefill's KV lands at its decode peer when the step in flight at its first token ends. Cases
small enough to work out by hand, each against the same case without the option."""

from __future__ import annotations

import pytest

from bench.fleet_sim.worker import Job, WorkerSpec
from bench.fleet_sim.workload import SimRequest
from planner.sizing import Counts
from tests.fleet_sim_cases import COST, seven_thousand_token_run
from tests.fleet_sim_cases import shared as fleet


def test_a_prompt_reaching_a_busy_worker_joins_the_step_after_the_next() -> None:
    # A: 100 tokens (0.02 s), then decode steps of 0.01 s ending 0.03, 0.04, ... B (400 tokens) arrives at 0.055,
    # inside the step 0.05-0.06. Planned at each boundary, B's chunk shares the step from 0.06 (0.01 + 400 x 1e-4,
    # the most one 50 ms step allows): first token at 0.11. Launched ahead, the step from 0.06 was planned at
    # 0.05, before B came: B joins the one from 0.07 and its first token comes at 0.12
    reqs = [SimRequest(0.0, 100, 40), SimRequest(0.055, 400, 3)]
    at_boundary, ahead = fleet(Counts(decode=1)), fleet(Counts(decode=1), launch_ahead=True)
    at_boundary.run(reqs)
    ahead.run(reqs)
    assert list(at_boundary.ttft) == pytest.approx([0.02, 0.055])
    assert list(ahead.ttft) == pytest.approx([0.02, 0.065])


def test_an_idle_worker_plans_at_once_with_launch_ahead() -> None:
    # nothing in flight: the engine reads the prompt and launches its step at once, as without the option
    reqs = [SimRequest(0.0, 1000, 5)]
    assert fleet(Counts(decode=1), launch_ahead=True).run(reqs).ttft_p50_s == pytest.approx(0.11)
    # and one that arrives while the only step in flight ends before anything else is known starts at its end
    f = fleet(Counts(decode=1), launch_ahead=True)
    f.run([SimRequest(0.0, 1000, 1), SimRequest(0.05, 500, 1)])
    assert list(f.ttft) == pytest.approx([0.11, 0.17 - 0.05])


def test_with_launch_ahead_a_newcomer_shares_a_run_s_last_chunk_only_if_it_came_two_steps_before() -> None:
    # 7,000 tokens alone: steps end at 0.2148, 0.4296, 0.6444 (full chunks) and 0.74 (its last 856 tokens). The last
    # chunk's step is planned when the one before it starts, at 0.4296
    spec = WorkerSpec(cost=COST, itl_target_s=0.05, launch_ahead=True)
    w = seven_thousand_token_run(spec)
    early = Job(1, 0.3, 1000, 1000, 0, 1000)
    w.add(early, 0.3)
    assert w.cut_span(0.3, early) == pytest.approx(3 * 0.2148)  # known by 0.4296: it shares the last chunk's step
    assert w.wake(3 * 0.2148) == pytest.approx(3 * 0.2148 + 0.1956)  # 0.01 + (856 + 1,000) x 1e-4

    w = seven_thousand_token_run(spec)
    late = Job(1, 0.5, 1000, 1000, 0, 1000)
    w.add(late, 0.5)
    assert w.cut_span(0.5, late) is None  # after 0.4296: the last chunk's step runs without it
    assert w.wake(0.74) == pytest.approx(0.74 + 0.11)


def test_on_a_shared_gpu_the_kv_lands_when_the_step_in_flight_at_the_first_token_ends() -> None:
    # A P+D pair on one GPU. A (1,000 tokens) is prefilled 0-0.11 s; B (500 tokens, one output token) arrives at 0.05
    # and is prefilled 0.11-0.17. Without the option A's KV lands a copy's time after its first token (1,000 tokens
    # at 200k tokens/s: 5 ms), 0.115; with it, when B's step, in flight at A's first token, ends: 0.17 + 5 ms
    reqs = [SimRequest(0.0, 1000, 3), SimRequest(0.05, 500, 1)]
    copy_after_token = fleet(Counts(prefill=1, decode=1), per_gpu=2, launch_ahead=True)
    after_step = fleet(Counts(prefill=1, decode=1), per_gpu=2, launch_ahead=True, notice_after_step=True)
    copy_after_token.run(reqs)
    after_step.run(reqs)
    assert copy_after_token.ttft[0] == pytest.approx(0.115)
    assert after_step.ttft[0] == pytest.approx(0.175)
    # B's step is the prefill worker's last: nothing is in flight at its first token, so its KV moves at once
    assert after_step.ttft[1] == pytest.approx(0.17 + 0.0025 - 0.05)


def test_on_gpus_of_their_own_the_kv_moves_at_the_first_token() -> None:
    # the same pair on two GPUs: the option is for a shared GPU only
    reqs = [SimRequest(0.0, 1000, 3), SimRequest(0.05, 500, 1)]
    f = fleet(Counts(prefill=1, decode=1), per_gpu=1, launch_ahead=True, notice_after_step=True)
    f.run(reqs)
    assert f.ttft[0] == pytest.approx(0.115)
