"""The router's candidate sampling (KVFERRY_ROUTER_SAMPLE_WORKERS, router/decision/dispatch.py
``choose_candidates``): with k, a request is scored on k ready workers of each role and the k holding the
longest prefix of it, not on every worker; a retry that excludes all those it sampled still finds a worker."""

from __future__ import annotations

import random

from router.decision.dispatch import Dispatcher, PromptPlan
from router.decision.load import parse_load
from router.decision.policy import RoutingPolicy
from router.decision.pool import WorkerPool
from router.settings import RouterOptions


def _pool(n: int) -> WorkerPool:
    pool = WorkerPool(client=None)  # type: ignore[arg-type]
    for role in ("decode", "prefill"):
        pool.set_targets(role, [f"http://{role}{i}" for i in range(n)])
        for i in range(n):
            snap = {"role": role, "pod": f"{role}{i}", "ready": True, "free_pages": 1000, "total_pages": 1000}
            pool.report_load(pool.workers[f"http://{role}{i}"], parse_load(snap))
    return pool


def _dispatcher(pool: WorkerPool, k: int) -> Dispatcher:
    return Dispatcher(
        pool,
        RoutingPolicy(),
        locator=None,  # type: ignore[arg-type]
        client=None,  # type: ignore[arg-type]
        opts=RouterOptions(sample_workers=k),
        rng=random.Random(7),
    )


def _plan(matches: dict[str, int]) -> PromptPlan:
    return PromptPlan(list(range(3000)), [], matches, 16)


def test_a_request_is_scored_on_k_of_each_role_and_the_prefix_holders() -> None:
    pool = _pool(20)
    dispatcher = _dispatcher(pool, 2)
    for _ in range(20):
        # prefill7 holds most of the prompt, decode3 some: both are candidates whatever the draw
        plan = _plan({"prefill7": 150, "decode3": 40, "decode9": 0})
        dispatcher.choose_candidates(plan)
        assert plan.candidates is not None
        urls = {w.url for w in plan.candidates}
        assert {"http://prefill7", "http://decode3"} <= urls
        assert sum(w.role == "decode" for w in plan.candidates) <= 3
        assert sum(w.role == "prefill" for w in plan.candidates) <= 3
        decision = dispatcher.route(plan, 16, set(), set())
        assert decision.decode in urls and (decision.prefill is None or decision.prefill in urls)


def test_draws_reach_every_worker() -> None:
    pool = _pool(10)
    dispatcher = _dispatcher(pool, 2)
    seen: set[str] = set()
    for _ in range(200):
        plan = _plan({})
        dispatcher.choose_candidates(plan)
        seen |= {w.url for w in plan.candidates or []}
    assert seen == set(pool.workers)


def test_a_retry_excluding_every_sampled_worker_looks_at_the_whole_pool() -> None:
    pool = _pool(6)
    dispatcher = _dispatcher(pool, 1)
    plan = _plan({})
    dispatcher.choose_candidates(plan)
    sampled = {w.url for w in plan.candidates or [] if w.role == "decode"}
    decision = dispatcher.route(plan, 16, sampled, set())
    assert decision.decode not in sampled and decision.decode in pool.workers


def test_without_sampling_every_ready_worker_is_a_candidate() -> None:
    pool = _pool(4)
    dispatcher = _dispatcher(pool, 0)
    plan = _plan({})
    dispatcher.choose_candidates(plan)
    assert plan.candidates is None
    leaving = pool.workers["http://decode2"]
    pool.report_load(leaving, parse_load({"role": "decode", "pod": "decode2", "ready": True, "draining": True}))
    routed = {dispatcher.route(_plan({}), 16, set(), set()).decode for _ in range(12)}
    assert routed == {"http://decode0", "http://decode1", "http://decode3"}  # the draining one is out
