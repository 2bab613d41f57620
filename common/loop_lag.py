"""How late an asyncio event loop runs what is due, measured by a timer that wakes every ``interval_s`` and records
its own lateness. A router relays every token of every stream on its loop: while it works through one decode
step's tokens, the streams it reaches last get theirs late, so the lateness's tail is the spread the relay adds to
inter-token gaps (the worker's engine cannot see it). The router hands it to the workers with each request
(`SamplingParams.itl_allowance_ms`), a decode worker adds its own HTTP process's, and the request's steps aim that
much under the class's ITL target.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from common.protocol import SamplingParams, replace

__all__ = ["LoopLag"]


@dataclass
class LoopLag:
    interval_s: float = 0.01
    window: int = 500  # samples kept: the last ~5 s at the default interval
    recompute_s: float = 0.5  # the tail is sorted out of the window at most this often
    _samples: deque[float] = field(default_factory=deque)
    _task: asyncio.Task[None] | None = None
    _tail_s: float = 0.0
    _tail_at: float = -1e9

    def start(self) -> None:
        if self._task is None:
            self._samples = deque(maxlen=self.window)
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self._samples.append(max(0.0, loop.time() - due))

    def p99_s(self) -> float:
        """The 99th percentile of the recent lateness (0 before any sample)."""
        now = time.monotonic()
        if now - self._tail_at >= self.recompute_s:
            samples = sorted(self._samples)
            self._tail_s = samples[int(0.99 * (len(samples) - 1))] if samples else 0.0
            self._tail_at = now
        return self._tail_s

    def add_to(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with this loop's recent lateness added to its ITL allowance, in whole ms (a worker keeps one
        count per distinct target among the requests it decodes; a calm loop's fraction of a ms adds nothing)."""
        ms = round(self.p99_s() * 1e3)
        return replace(sampling, itl_allowance_ms=sampling.itl_allowance_ms + ms) if ms else sampling
