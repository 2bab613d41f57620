"""The collector's pauses: counted per collection, and the startup's objects kept out of its walks."""

from __future__ import annotations

import gc
import time

from common.gc_pauses import FULL_AFTER_YOUNGER, GcPauses, freeze_startup_objects
from common.protocol import GenerateRequest, decode
from router.surface.openai_api import CompletionRequest


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_each_collection_is_counted_with_its_pause_until_uninstalled() -> None:
    pauses = GcPauses().install()
    try:
        for _ in range(3):
            for _ in range(100):
                _Cycle()
            gc.collect()
        assert pauses.count >= 3
        assert 0 < pauses.max_s <= pauses.total_s
    finally:
        pauses.uninstall()
    seen = pauses.count
    gc.collect()
    assert pauses.count == seen


def test_the_router_publishes_each_of_its_collections_as_a_pause_histogram() -> None:
    """The router's process hands each pause to `kvferry_router_gc_pause_seconds` (router/app.py's lifespan)."""
    from router.metrics import RouterMetrics

    metrics = RouterMetrics()
    pauses = GcPauses(on_pause=metrics.gc_pause.observe).install()
    try:
        gc.collect()
        gc.collect()
    finally:
        pauses.uninstall()
    assert pauses.flush() >= 2
    count = metrics.registry.get_sample_value("kvferry_router_gc_pause_seconds_count")
    total = metrics.registry.get_sample_value("kvferry_router_gc_pause_seconds_sum")
    assert count == pauses.count >= 2 and total is not None and abs(total - pauses.total_s) < 1e-9


def test_a_workers_http_process_publishes_its_collections_while_it_serves() -> None:
    """The worker's HTTP process relays every stream of its engine, so its collections are measured as the
    router's are (`watch_collector` in its lifespan, common/worker/control.py): each one while it serves reaches
    `kvferry_worker_gc_pause_seconds`, none after."""
    import asyncio

    from common.gc_pauses import watch_collector
    from common.worker.worker_metrics import WorkerMetrics

    metrics = WorkerMetrics()

    async def serve() -> int:
        async with watch_collector(metrics.http_gc_pause.observe, freeze=False) as pauses:
            gc.collect()
            gc.collect()
            pauses.flush()
            return pauses.count

    seen = asyncio.run(serve())
    gc.collect()
    assert seen >= 2
    assert metrics.registry.get_sample_value("kvferry_worker_gc_pause_seconds_count") == seen


def test_objects_alive_at_freeze_leave_the_collectors_generations() -> None:
    kept = [_Cycle() for _ in range(1000)]
    thresholds = gc.get_threshold()
    try:
        frozen = freeze_startup_objects()
        assert frozen >= len(kept)
        assert sum(gc.get_count()) < len(kept)  # the young generations no longer hold them
        assert gc.get_threshold()[2] >= FULL_AFTER_YOUNGER  # full collections spaced out
        for _ in range(10):
            _Cycle()  # garbage made after the freeze is still collected
        assert gc.collect() >= 10
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_a_prompts_token_ids_are_not_walked_by_full_collections() -> None:
    """What the router and a worker's HTTP process hold for a request's life: its prompt's ids, as tuples, which the
    collector stops tracking once it has seen them (a list of 2k ids is 2k items each full collection walks)."""
    wire = decode(b'{"req_id":"r","token_ids":[5,6,7],"sampling":{"max_tokens":4}}', GenerateRequest)
    body = CompletionRequest.model_validate({"model": "m", "prompt": [5, 6, 7]})
    batch = CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6], [7]]})
    held = [wire.token_ids, body.prompt, *batch.prompts()]
    gc.collect()
    assert [gc.is_tracked(ids) for ids in held] == [False] * 4
    assert body.prompts() == [(5, 6, 7)]


def test_a_slow_collection_is_logged_with_its_generations_size_at_most_once_a_minute(monkeypatch, caplog) -> None:
    """The line says whether a long pause walked a large heap or waited for a core: the objects the collected
    generation holds and those frozen out of it; the walk that counts them runs at most once a minute."""
    import logging

    from common import gc_pauses

    monkeypatch.setattr(gc_pauses, "SLOW_PAUSE_S", 0.0)  # every collection counts as slow here
    kept = [_Cycle() for _ in range(2000)]
    pauses = GcPauses().install()
    gc.disable()  # only the two collections below
    try:
        with caplog.at_level(logging.WARNING, logger="kvferry.gc"):
            gc.collect()
            gc.collect()
            assert not [r for r in caplog.records if r.name == "kvferry.gc"]  # nothing from the callback itself
            pauses.flush()
    finally:
        gc.enable()
        pauses.uninstall()
    lines = [r for r in caplog.records if r.getMessage() == "slow garbage collection"]
    assert len(lines) == 2
    assert lines[0].generation == 2 and lines[0].objects >= len(kept) and lines[0].frozen >= 0
    assert not hasattr(lines[1], "objects")
    assert 0 <= time.time() - lines[1].at < 60 and lines[0].at <= lines[1].at  # when each ended, wall clock


def test_a_collection_inside_a_metric_update_does_not_wait_on_that_metrics_lock() -> None:
    """A collection can start inside any allocation, a metric's lock held: the callback hands nothing to the
    metric (a router process froze for good when it did: one lock for every metric in multiprocess mode), and
    `flush` observes the pause afterwards."""
    import threading

    from router.metrics import RouterMetrics

    metrics = RouterMetrics()
    histogram = metrics.gc_pause
    pauses = GcPauses(on_pause=histogram.observe).install()
    held = histogram._sum._lock  # the lock prometheus_client holds while it adds to the histogram's sum

    def collect_while_held() -> None:
        with held:
            gc.collect()

    try:
        worker = threading.Thread(target=collect_while_held, daemon=True)
        worker.start()
        worker.join(timeout=10)
        assert not worker.is_alive(), "the collector's callback waited on a lock its own thread held"
    finally:
        pauses.uninstall()
    assert pauses.flush() >= 1
    assert metrics.registry.get_sample_value("kvferry_router_gc_pause_seconds_count") == pauses.count
