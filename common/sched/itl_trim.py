"""How much of the ITL target a step with a prompt chunk aims at, kept by the gaps those steps measure.

The budget (common/sched/prefill_budget.py) predicts a chunk's step within the target less the step-time
model's residual spread, as if its errors were normal. They are not: a host hiccup, a batch that just grew or a
prompt's attention over a long prefix land a step above any Gaussian margin, and a request's own ITL p99 over
a few hundred gaps is its second- or third-largest gap (under a hundred gaps, its largest). For 99% of requests
to hold the target, steps beside decoding may overrun it a few times in ten thousand, not once in a hundred.

So each such step's measured period is checked against the target it was planned for: an overrun cuts the
share of the target the budget aims at (`cut`), a run of `calm_steps` without one gives a little back
(`regrow`), never above the whole target nor under `floor`. Multiplicative decrease against slow increase
settles where overruns are about one in `calm_steps * ln(1/cut) / ln(regrow)` (~2,500) chunk steps.
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
        """One step that carried a prompt chunk beside decoding rows: its period and the target it had."""
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
