"""Whether a worker's engine process is moving: what a long-running exchange reports as progress.

A prefill worker keeps a decode peer's wait alive with heartbeats while its engine works (decode_worker/remote_prefill.py
gives up on a prefill that shows none for a while instead of after a fixed time). Moving means one of two
things since the last look: a load snapshot arrived (the engine loop turned; it sends one every 0.1 s between
steps) or the engine process used CPU time (one long step under way, e.g. a 2k-token chunk on a busy CPU). A
stopped (SIGSTOP) or deadlocked engine does neither.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["EngineMotion", "process_cpu_ticks"]


def process_cpu_ticks(pid: int) -> int | None:
    """User + system CPU time of a process in clock ticks (Linux /proc); None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces or parentheses: the fields after it follow the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    except (IndexError, ValueError):
        return None


@dataclass
class EngineMotion:
    """``moved()`` is True when the engine showed a sign of work since the previous call."""

    last_load: Callable[[], object]  # the control plane's latest load snapshot (a new object per snapshot)
    pid: Callable[[], int | None]  # the engine process id (None: not started)
    _load: object = None
    _ticks: int | None = None

    def __post_init__(self) -> None:
        self._load = self.last_load()
        self._ticks = self._cpu()

    def _cpu(self) -> int | None:
        pid = self.pid()
        return None if pid is None or not os.path.exists("/proc") else process_cpu_ticks(pid)

    def moved(self) -> bool:
        load, ticks = self.last_load(), self._cpu()
        moved = load is not self._load or (ticks is not None and self._ticks is not None and ticks > self._ticks)
        self._load, self._ticks = load, ticks
        return moved
