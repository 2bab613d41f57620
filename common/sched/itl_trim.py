"""How much of the ITL target a step with a prompt chunk aims at, kept by the gaps those steps measure. Step
errors are not normal (a batch that just grew, a context the fit has not seen), and a request's p99 over a few
hundred gaps is about its second-largest, so steps beside decoding may overrun only rarely: an overrun cuts the
share (`cut`), `calm_steps` without one regrow it a little. The two settle where overruns come at the rate
`allow_overruns` sets from the SLO's percentile.

Only overruns the chunk caused count: a gap that is mostly host time (the device busy for less than half of it:
a stall between steps) would be as long with any chunk, and cutting the budget for it costs TTFT and saves no
tail (`device_share_of_overrun`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ItlTrim", "OVERRUNS_PER_TAIL", "learnt_step_s", "stall_dominated"]

# Of the gaps a percentile target lets past (1% for p99), the share chunk steps may use: a request of a few dozen
# gaps can afford at most one, chunk steps are not the only gaps that run long, and the step model's errors come
# in runs (a batch the fit has not seen), not one at a time. A fifth of the tail let FP8 on the H200 overrun in runs
# (40% of requests missed at low load); a twenty-fifth held both dtypes (bench/RESULTS.md).
OVERRUNS_PER_TAIL = 0.04
DEVICE_SHARE_OF_STEP = 0.5  # below this share of a gap on the device, the gap is a host stall, not the step's cost


def stall_dominated(period_s: float, device_s: float) -> bool:
    """Whether a gap between steps was mostly host time the step's own work does not explain."""
    return device_s > 0 and device_s < DEVICE_SHARE_OF_STEP * period_s


def learnt_step_s(period_s: float, device_s: float) -> float:
    """What the step-time model learns from a step: its period, unless that was mostly a stall, which learnt
    would pull the fit and widen the margin for the whole window, shrinking every chunk for a gap no chunk caused."""
    return device_s if stall_dominated(period_s, device_s) else max(device_s, period_s)


@dataclass
class ItlTrim:
    factor: float = 1.0  # the share of the ITL target the next chunk step's budget aims at
    floor: float = 0.6  # below, the prompt's progress would cost more TTFT than the tail it saves
    cut: float = 0.95
    regrow: float = 1.01
    calm_steps: int = 485  # set by allow_overruns; 485: one overrun in ~2,500 chunk steps (p99)
    overruns: int = 0  # chunk steps beside decoding that ran past their target (a counter)
    stalls: int = 0  # gaps past the target that were mostly host time (counted, not cut for)
    _calm: int = 0

    def allow_overruns(self, rate: float) -> ItlTrim:
        """Sets the calm run so that one cut is regrown after 1/rate chunk steps: the overrun rate it settles at."""
        regrows_per_cut = math.log(1 / self.cut) / math.log(self.regrow)
        self.calm_steps = max(1, round(1 / (rate * regrows_per_cut)))
        return self

    def observe(self, period_s: float, target_s: float, device_s: float = 0.0) -> None:
        """One step that carried a chunk beside decoding rows: the gap its streams saw, their target and the
        step's device time (0: not timed, the gap is taken as the step's)."""
        if target_s <= 0 or period_s <= 0:
            return
        if period_s > target_s:
            if stall_dominated(period_s, device_s):
                self.stalls += 1
                return
            self.overruns += 1
            self.factor = max(self.floor, self.factor * self.cut)
            self._calm = 0
            return
        self._calm += 1
        if self._calm >= self.calm_steps:
            self.factor = min(1.0, self.factor * self.regrow)
            self._calm = 0
