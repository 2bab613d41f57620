"""An engine's start, phase by phase (only those that ran), each logged as one line when it ends and kept for
``kvferry_worker_start_phase_seconds{phase=...}``: `process` (the engine process's own start: the interpreter and
its imports, from the worker's spawn to the engine's entry), `weights`, `kv_pool` (the KV pool's allocation),
`kernels`, `graphs`, `transfer` (the NIXL agent and the pool's registration), `warm_up`, `host_tier` (the host KV
tier's allocation, where the worker has one; its page-locking follows the start). What the phases leave of
the whole (``kvferry_worker_start_seconds``) is the device's own set-up and the rest of the engine's objects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["PHASES", "StartPhases"]

log = logging.getLogger("kvferry.engine")

PHASES = ("process", "weights", "kv_pool", "kernels", "graphs", "transfer", "warm_up", "host_tier")


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
