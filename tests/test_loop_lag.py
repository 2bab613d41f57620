"""The router's relay lateness (common/loop_lag.py), and the ITL target a request's steps aim at once its router
has told the worker that lateness (common/slo.py `SloClass.engine_itl_s`, the scheduler's admission)."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.loop_lag import LoopLag
from common.slo import MAX_ALLOWANCE_SHARE, parse_slo_classes


def test_a_loop_busy_for_a_while_shows_that_lateness_in_its_tail() -> None:
    async def main() -> tuple[float, float]:
        lag = LoopLag(interval_s=0.005, recompute_s=0.0)
        lag.start()
        await asyncio.sleep(0.1)
        calm = lag.p99_s()
        for _ in range(3):
            time.sleep(0.06)  # what relaying one step's tokens to many streams does to the loop, exaggerated
            await asyncio.sleep(0.02)
        busy = lag.p99_s()
        await lag.stop()
        return calm, busy

    calm, busy = asyncio.run(main())
    assert busy >= 0.05 > calm


def test_an_allowance_lowers_the_engines_itl_target_by_at_most_a_share_of_it() -> None:
    interactive = parse_slo_classes("interactive:ttft=1s,itl=50ms").get("interactive")
    assert interactive.engine_itl_s(0.0) == pytest.approx(0.05)
    assert interactive.engine_itl_s(0.004) == pytest.approx(0.046)
    assert interactive.engine_itl_s(1.0) == pytest.approx(0.05 * (1 - MAX_ALLOWANCE_SHARE))


def test_a_requests_itl_allowance_sets_the_target_its_steps_aim_at(tiny_model) -> None:
    """The allowance its router sent, or the worker's own KVFERRY_ITL_DELIVERY_MS when larger."""
    from common.protocol import SamplingParams
    from common.sched.request import Req
    from common.sched.scheduler import Scheduler
    from common.settings import SchedulerConfig
    from tests.test_scheduler import make_engine

    runner = make_engine(tiny_model).runner
    told = Req(req_id="a", prompt_ids=[1, 2, 3], sampling=SamplingParams(itl_allowance_ms=6.0))
    plain = Req(req_id="b", prompt_ids=[1, 2, 3], sampling=SamplingParams())
    sched = Scheduler(runner, SchedulerConfig(itl_delivery_ms=2.0), overlap=False)
    sched.validate(told)
    sched.validate(plain)
    assert told.itl_target_s == pytest.approx(0.044)  # the default class: 50 ms
    assert plain.itl_target_s == pytest.approx(0.048)


def test_each_relaying_process_adds_its_own_lateness_to_a_requests_allowance() -> None:
    """The router sets the allowance from its loop, the decode worker adds its own (`LoopLag.add_to`), in whole
    ms."""
    from common.protocol import SamplingParams

    async def main() -> tuple[SamplingParams, SamplingParams]:
        router, worker = LoopLag(interval_s=0.005, recompute_s=0.0), LoopLag(interval_s=0.005, recompute_s=0.0)
        router.start()
        worker.start()
        await asyncio.sleep(0.03)
        for _ in range(3):  # both loops (one loop here) held up 30 ms, a few times
            time.sleep(0.03)
            await asyncio.sleep(0.01)
        sent = router.add_to(SamplingParams(max_tokens=7))
        taken = worker.add_to(sent)
        await router.stop()
        await worker.stop()
        return sent, taken

    quiet = SamplingParams()
    assert LoopLag().add_to(quiet) is quiet  # no lateness measured: the request goes as it came
    sent, taken = asyncio.run(main())
    assert sent.itl_allowance_ms >= 20 and sent.itl_allowance_ms == int(sent.itl_allowance_ms)
    assert taken.itl_allowance_ms >= sent.itl_allowance_ms + 20 and taken.max_tokens == 7
