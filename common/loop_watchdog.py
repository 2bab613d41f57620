"""A watchdog for a process's asyncio event loop: a loop that stops running is found and said, and, where the
process has a supervisor to start a fresh one, ended.

A loop stuck on a blocking call, a lock held elsewhere or a native call that never returns shows only as streams
that go silent: nothing is logged, and the process still answers its supervisor's pings from another thread
(uvicorn's). So a timer on the loop pushes faulthandler's deadline back as it runs: a loop stuck for
``dump_after_s`` has every thread's stack written to stderr by faulthandler's own thread, which needs neither the
loop nor the GIL. With ``exit_after_s`` a thread of its own ends the process once the loop has been stuck that
long, stacks written again first: uvicorn starts a new router process in its place (a single process: the pod
restarts), and clients whose streams it held get a closed connection to retry instead of silence. That is how a
router process frozen by its garbage collector's callback was found (bench/RESULTS.md, "A router process frozen
by its own garbage collector"): every stream it held stayed silent until the clients gave up.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field

from common.settings_registry import LOOP_STALL_DUMP_S

__all__ = ["STALL_EXIT_CODE", "LoopWatchdog"]

log = logging.getLogger("kvferry.loop")

BEAT_S = 1.0  # how often a running loop pushes the deadlines back, at most (a call costs a few us)
STALL_EXIT_CODE = 70  # EX_SOFTWARE; not uvicorn's 3, which stops its supervisor instead of restarting the process


@dataclass
class LoopWatchdog:
    dump_after_s: float = field(default_factory=LOOP_STALL_DUMP_S.read)  # 0: no stacks written
    exit_after_s: float = 0.0  # 0: the process is never ended for a stuck loop
    _task: asyncio.Task[None] | None = None
    _guard: threading.Thread | None = None
    _stopped: threading.Event = field(default_factory=threading.Event)
    _beat: float = 0.0  # time.monotonic() of the loop's latest turn of the timer

    @property
    def period_s(self) -> float:
        # well inside the shortest limit: a loop that runs is never taken for a stuck one
        limits = [s for s in (self.dump_after_s, self.exit_after_s) if s > 0]
        return min([BEAT_S, *(s / 4 for s in limits)])

    def start(self) -> None:
        if self._task is not None or (self.dump_after_s <= 0 and self.exit_after_s <= 0):
            return
        if threading.current_thread() is not threading.main_thread():
            # A loop on a background thread (an app served inside tests or a benchmark, router/server_thread.py)
            # belongs to a host program: faulthandler's timer is one per process, and an exit would end the host.
            return
        self._beat = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-watchdog")
        if self.exit_after_s > 0:
            self._stopped.clear()
            self._guard = threading.Thread(target=self._watch_exit, name="loop-watchdog", daemon=True)
            self._guard.start()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self._stopped.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if self.dump_after_s > 0:
            faulthandler.cancel_dump_traceback_later()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.period_s
            if self.dump_after_s > 0:
                faulthandler.dump_traceback_later(self.dump_after_s, repeat=False, file=sys.stderr, exit=False)
            await asyncio.sleep(self.period_s)
            self._beat = time.monotonic()
            late = loop.time() - due
            if self.dump_after_s > 0 and late >= self.dump_after_s:
                log.warning("event loop stalled", extra={"seconds": round(late, 3)})

    def _watch_exit(self) -> None:
        while not self._stopped.wait(self.period_s):
            stuck = time.monotonic() - self._beat
            if stuck < self.exit_after_s:
                continue
            # No logging here: the stuck thread may hold the logging lock. Plain writes and faulthandler take none.
            os.write(2, f"event loop stuck for {stuck:.1f} s: exiting so a fresh process takes over\n".encode())
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            os._exit(STALL_EXIT_CODE)
