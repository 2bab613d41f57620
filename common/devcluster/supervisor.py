"""Keeps a local cluster's parts running, as a kubelet keeps a pod's containers: a part that exits is started
again on its address after a back-off that doubles while it keeps failing (1 s up to 30 s, reset once it has
stayed up for a minute), with its log tail printed. The router notices by itself: its health polls take the
part out of routing while it is gone and put it back once it answers /ready, and the other parts serve on
meanwhile (router/upstream/migration.py moves the streams of a lost decode worker)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.devcluster.process import ManagedProcess

__all__ = ["Supervisor"]

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_S = 60.0  # up this long: the next exit starts the back-off from the beginning


@dataclass
class _Watch:
    failures: int = 0  # exits since the part was last stable
    restarts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None  # set while the part is down and waiting for its back-off


@dataclass
class Supervisor:
    parts: Sequence[ManagedProcess]
    say: Callable[[str], None] = lambda _msg: None
    backoff_s: Sequence[float] = BACKOFF_S
    stable_s: float = STABLE_S
    _watch: dict[int, _Watch] = field(default_factory=dict)

    def __post_init__(self) -> None:
        now = time.monotonic()
        self._watch = {id(p): _Watch(started_at=now) for p in self.parts}

    @property
    def restarts(self) -> dict[str, int]:
        return {p.name: self._watch[id(p)].restarts for p in self.parts}

    def check(self, now: float | None = None) -> None:
        """One look at every part: schedules the restart of one that exited, starts those whose back-off is over."""
        now = time.monotonic() if now is None else now
        for part in self.parts:
            w = self._watch[id(part)]
            if part.alive():
                if w.failures and now - w.started_at >= self.stable_s:
                    w.failures = 0
                continue
            if w.restart_at is None:
                delay = self.backoff_s[min(w.failures, len(self.backoff_s) - 1)]
                code = part.proc.returncode if part.proc is not None else None
                self.say(
                    f"{part.name} exited (code {code}); restarting it in {delay:g} s (log {part.log_path}):\n"
                    f"{part.log_tail(10)}"
                )
                w.restart_at = now + delay
            elif now >= w.restart_at:
                part.kill_group()  # what the part left behind (its engine process) goes with it
                part.start()
                w.failures += 1
                w.restarts += 1
                w.started_at = now
                w.restart_at = None
                self.say(f"{part.name} restarted (restart {w.restarts}) at {part.url}")
