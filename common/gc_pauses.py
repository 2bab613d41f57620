"""Python's cyclic garbage collector, kept out of the token gaps.

A full (generation 2) collection walks every tracked object: after a model, its modules and captured graphs are
built, that is a pause long enough to show as one inter-token gap far above an ITL target, and a request's own
ITL p99 over a few hundred gaps is its largest gap or two. So once a process has started, everything built so far
is frozen out of the collector (`gc.freeze`: never collected, never walked again), and each collection's pause is
measured so that a long one is visible (`/load`, `kvferry_gc_pause_*`, one warning line).

What a full collection still walks is what the process holds for its requests in flight, and a walk is mostly
cache misses (~250 ns an object): a router relaying 300 streams held ~70k objects, a 20-30 ms pause. Token ids
are kept as tuples (common/protocol.py TokenIds), which the collector stops walking; and a full collection waits
for ten times the default count of younger collections (`FULL_AFTER_YOUNGER`), so it comes ~10x less often. The
price is cyclic garbage that reached the oldest generation living that much longer: a request's few cycles, not
its pages or its lists, which reference counting frees as ever.

The collector's callback runs wherever a collection starts: inside any code that allocates, locks held. So it
only counts and queues the pause; the metric and the log line are written by `flush`, from the process's own
code. A callback that observed a Prometheus metric itself froze a router process for good: in multiprocess mode
every metric of a process shares one non-reentrant lock, a collection started while another metric held it, and
the callback waited on it forever (H200, FP8 at 24-30 req/s: a third of the streams went silent, nothing logged).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

__all__ = ["GcPauses", "freeze_startup_objects", "watch_collector"]

log = logging.getLogger("kvferry.gc")

SLOW_PAUSE_S = 0.02  # a collection longer than this is logged: it is a visible share of a 50 ms ITL target
# A slow collection's line also says how many objects its generation holds (a walk of them: a few ms per million),
# at most this often: whether the pause is the heap's size or the process waiting for a core.
CENSUS_EVERY_S = 60.0
# Collections of the middle generation before a full one (CPython's default: 10). The router at 300 streams ran a full
# collection every ~10 s with the default (bench/router.py --capacity-only --prompt-ids 1800).
FULL_AFTER_YOUNGER = 100
PENDING_KEPT = 4096  # pauses queued for `flush`; a process that never flushes keeps only the last ones


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now out of the collector's reach, and space full collections
    out (`FULL_AFTER_YOUNGER`); returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, max(full, FULL_AFTER_YOUNGER))
    return gc.get_freeze_count()


@dataclass
class GcPauses:
    """Each collection's pause, from the collector's own start/stop callbacks (one per collection, not per
    object: free on the hot path); `flush` hands the queued ones on."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    on_pause: Callable[[float], None] | None = None  # each pause in seconds (a metric's observe), from `flush`
    # (seconds, generation, collected, wall clock at its end) of each collection not yet flushed; append and popleft
    # need no lock
    _pending: deque[tuple[float, int, int, float]] = field(default_factory=lambda: deque(maxlen=PENDING_KEPT))
    _started: float = 0.0
    _installed: bool = False
    _census_at: float = -CENSUS_EVERY_S

    def install(self) -> GcPauses:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # Nothing here may take a lock or log (the module's docstring says why).
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        self.count += 1
        self.total_s += took
        self.max_s = max(self.max_s, took)
        self._pending.append((took, info.get("generation", 2), info.get("collected", 0), time.time()))

    def flush(self) -> int:
        """Hands each queued pause to `on_pause` and logs the slow ones; returns how many. Call it from the
        process's own code, never from a collector callback."""
        pending, n = self._pending, 0
        while pending:
            took, generation, collected, ended = pending.popleft()
            n += 1
            if self.on_pause is not None:
                self.on_pause(took)
            if took >= SLOW_PAUSE_S:
                self._log_slow(took, generation, collected, ended)
        return n

    async def flush_every(self, interval_s: float = 1.0) -> None:
        """`flush` on an event loop, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.flush()

    def _log_slow(self, took: float, generation: int, collected: int, ended: float) -> None:
        # `at`: when it ended, wall clock in seconds (the line is written up to a second later, by `flush`), which
        # bench/gap_sources.py lines up with the token gaps clients saw
        extra = {"generation": generation, "ms": round(took * 1e3, 1), "collected": collected, "at": round(ended, 3)}
        now = time.monotonic()
        if now - self._census_at >= CENSUS_EVERY_S:
            self._census_at = now
            extra["objects"] = len(gc.get_objects(generation))
            extra["frozen"] = gc.get_freeze_count()
        log.warning("slow garbage collection", extra=extra)


@asynccontextmanager
async def watch_collector(on_pause: Callable[[float], None], freeze: bool) -> AsyncIterator[GcPauses]:
    """A serving process's HTTP side for as long as it serves (an app's lifespan): its startup objects frozen when
    `freeze` (a process of its own: an app inside a test or a benchmark belongs to a host program), each pause
    handed to `on_pause` (a metric's observe) and the slow ones logged, once a second from the loop."""
    if freeze:
        freeze_startup_objects()
    pauses = GcPauses(on_pause=on_pause).install()
    flushing = asyncio.get_running_loop().create_task(pauses.flush_every(), name="gc-pauses")
    try:
        yield pauses
    finally:
        pauses.uninstall()
        flushing.cancel()
