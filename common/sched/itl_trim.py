"""How much of the ITL target a step with a prompt chunk aims at, kept by the gaps those steps measure. Step
errors are not normal (host hiccups, a grown batch), and a request's p99 over a few hundred gaps is about its
second-largest, so steps beside decoding may overrun only a few times in ten thousand: an overrun cuts the share
(`cut`), `calm_steps` without one regrow it a little, settling near one overrun per ~2,500 chunk steps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ItlTrim:
    factor: float = 1.0  # the share of the ITL target the next chunk step's budget aims at
    floor: float = 0.6  # below, the prompt's progress would cost more TTFT than the tail it saves
    cut: float = 0.95
    regrow: float = 1.01
    calm_steps: int = 500
    overruns: int = 0  # chunk steps beside decoding that ran past their target (a counter)
    _calm: int = 0

    def observe(self, period_s: float, target_s: float) -> None:
        """One step that carried a chunk beside decoding rows: its period and its target."""
        if target_s <= 0 or period_s <= 0:
            return
        if period_s > target_s:
            self.overruns += 1
            self.factor = max(self.floor, self.factor * self.cut)
            self._calm = 0
            return
        self._calm += 1
        if self._calm >= self.calm_steps:
            self.factor = min(1.0, self.factor * self.regrow)
            self._calm = 0
