"""A prompt its decode worker gave back (placed there for lack of a prefill worker, then moved once one came back
up) is placed again by the router's real dispatcher. That worker drops the prompt at its engine's next step, so
its first snapshots after the move may still count the prompt's pages: the re-placement waits for snapshots that
no longer do (a few poll intervals) instead of answering the client 429, and still refuses once they keep
saying there is no room."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.protocol import SamplingParams
from router.decision.dispatch import Dispatcher, PromptPlan
from router.decision.load import Load
from router.decision.policy import RoutingPolicy
from router.decision.pool import WorkerPool
from router.errors import OpenAIError
from router.settings import RouterOptions
from router.upstream import call as call_module
from router.upstream.call import UpstreamCall

POLL_S = 0.01
PAGES, PAGE = 256, 16
PROMPT = 1820  # tokens: with max_tokens 3 it takes 114 pages, and the worker keeps as much free again


def _load(free_pages: int) -> Load:
    # a per-request cap of half the pool: admission keeps room for one more such request beside this one
    return Load(
        role="decode",
        pod="decode-0",
        free_pages=free_pages,
        total_pages=PAGES,
        page_size=PAGE,
        ready=True,
        max_running=8,
        max_request_tokens=PAGES * PAGE // 2,
    )


def _call() -> tuple[UpstreamCall, WorkerPool]:
    pool = WorkerPool(client=None, opts=RouterOptions(poll_interval_s=POLL_S))  # type: ignore[arg-type]
    pool.add("http://decode-0", "decode")
    dispatcher = Dispatcher(pool, RoutingPolicy(), locator=None, client=None)  # type: ignore[arg-type]
    plan = PromptPlan(list(range(PROMPT)), [], {}, PAGE)
    return UpstreamCall(dispatcher, "req-1", plan, SamplingParams(max_tokens=3)), pool


async def _polls(pool: WorkerPool, loads: list[Load]) -> None:
    """The pool's polls, one snapshot per interval: `loads` in turn, the last one from then on."""
    w = pool.workers["http://decode-0"]
    for i in range(10_000):
        pool.report_load(w, loads[min(i, len(loads) - 1)], asked=time.monotonic())
        await asyncio.sleep(POLL_S)


async def _place_given_back(loads: list[Load]) -> object:
    call, pool = _call()
    pool.report_load(pool.workers["http://decode-0"], loads[0], asked=time.monotonic())
    moved_at = time.monotonic()
    polls = asyncio.create_task(_polls(pool, loads))
    try:
        return await call._route_given_back(moved_at, set(), set())
    finally:
        polls.cancel()


def test_a_given_back_prompt_waits_for_snapshots_that_no_longer_count_it() -> None:
    still_counted = _load(PAGES - 114)  # the prompt's own pages, not yet dropped
    dropped = _load(PAGES)
    decision = asyncio.run(_place_given_back([still_counted] * 4 + [dropped]))
    assert decision.decode == "http://decode-0"  # type: ignore[attr-defined]


def test_a_worker_that_stays_full_still_refuses_it_once_the_snapshots_had_their_time() -> None:
    full = _load(PAGES - 114)
    started = time.monotonic()
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(_place_given_back([full]))
    assert refused.value.status == 429
    # refused only after the settle window (GIVEN_BACK_SETTLE_POLLS polls), not at the first snapshot
    assert time.monotonic() - started >= call_module.GIVEN_BACK_SETTLE_POLLS * POLL_S
