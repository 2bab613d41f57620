"""An engine's start, phase by phase (weights, kernels, graphs, warm_up; only those that ran), each logged as one
line when it ends and kept for ``kvferry_worker_start_phase_seconds{phase=...}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["PHASES", "StartPhases"]

log = logging.getLogger("kvferry.engine")

PHASES = ("weights", "kernels", "graphs", "warm_up")


@dataclass
class StartPhases:
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds, in the order they ran

    def record(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown start phase {phase!r} (one of {', '.join(PHASES)})")
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        log.info("start phase", extra={"phase": phase, "seconds": round(seconds, 3)})

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Records `phase` as the time the block took (not when it raises: the engine did not start)."""
        start = time.perf_counter()
        yield
        self.record(phase, time.perf_counter() - start)
