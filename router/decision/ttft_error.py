"""The TTFT prediction's own error, fed back into admission: served requests' measured TTFT over their predicted
TTFT, kept over the last seconds, scale the predictions admission compares with a class's target by an upper
quantile of that ratio (at least 1, at most `MAX_FACTOR`).

Why: the prediction (router/decision/ttft_model.py) is exact only where the worker's fitted step model is. On a
card or a workload it fits less well, queued prompts take longer than predicted as the decode batch grows beside
them, and admission lets in requests that then miss the target: FP8 on an H100 admitted 8-13% of requests at 2x
saturation that came back 1.0-1.9 s late (bench/RESULTS.md, "The host tier's pieces ..."). The error a router
observes is the error its own admission makes, so it corrects itself without a constant fitted to one card.

Only requests near deciding admission count: predicted or measured at `RELEVANT_SHARE` of the class's target or
more. A request both predicted and served quickly has a ratio dominated by fixed costs outside the worker
(tokenization, the first event's relay) that says nothing about a queue's; one predicted quickly and served late
is the error that matters most (a step model far off: on a 2-core CPU shared by two workers, the router and the
client, admitted requests took 3-4x their predictions). A router that observes nothing (the fleet simulator
unless `error_feedback` is on, a worker not yet measured) keeps the factor 1: the predictions as they are.

Why the error must show twice: the factor corrects a prediction that is off in proportion (a step model that
under-predicts a queue), which shedding earlier fixes. A stall (a compile, a collection, the first second of a
load step before the polls see its queue) delays the requests in flight by a fixed time, which shedding earlier
does not fix, and with a 0.99 quantile over a few hundred samples three such requests pinned the factor at its
ceiling for the whole horizon: on an H100 (bench/RESULTS.md, "The TTFT error factor held to what recurs") one
stall of ~1 s at a fresh FP8 worker's first point kept a lone router process at 2.0 for its next three points, 15
requests shed at 12 req/s (half of saturation), and a load step's first half second put two processes at 2.0
past saturation, 11.0-11.7 good requests/s against 18.0 at the peak. So the factor is the smaller of the quantile
over the last period and over the period before it, `GAP_S` apart, each `PERIOD_S` and `MIN_SAMPLES` relevant
requests at least: an error that recurs sets it within one to two periods, one confined to a few seconds does not
set it at all, and with no relevant request served for `PERIOD_S` the predictions stand again. In the fleet
simulator fed back (bench/fleet_sim/error_factor.py, serve.py-like 10 s points, five seeds; RESULTS.md): admitted
requests 99.6-100% good at 2x and 3x saturation against 98.4-99.0% with no feedback, and good requests/s -0.3% to
+3.8% of no feedback's, where the 2-minute maximum cost four prefill and four decode pods behind two router processes
6% at 3x; periods of 10 s were too slow for a 10 s overload (98.9% there, as with none).

Why the 0.99 quantile: a request admitted at the edge (predicted = target / factor) misses with the chance that
its ratio exceeds the factor, 1 - quantile. Deep in overload nearly every admitted request sits at that edge (the
queue refills to it as fast as it drains), so the quantile is the share of admitted requests that meet the target
there: with 0.9 the H200 served 92.9% (FP8) and 97.2% (bf16) of admitted requests within it at 3x saturation,
against the 99% asked. A higher quantile costs little goodput: it only shortens the queue a worker is allowed to
hold, and a worker stays busy while any prompt waits (with a 1 s target and a factor of 2, half a second of
prompts, tens of them).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

__all__ = ["GAP_S", "HORIZON_S", "MAX_FACTOR", "MIN_SAMPLES", "PERIOD_S", "RELEVANT_SHARE", "PredictionError"]

# A request predicted and served under this share of its target was far from deciding admission.
RELEVANT_SHARE = 0.25
# The two periods the error must show in: each at least this long and at least MIN_SAMPLES relevant requests
# long (at a few relevant requests a second, a period stretches to hold that many). A correction follows a
# recurring error within one to two periods, and lapses PERIOD_S after the last relevant request was served.
PERIOD_S = 5.0
# Between the two periods: longer than a stall or a load step's blind first second, so one cannot span both.
GAP_S = 2.0
# The fewest relevant requests a period's quantile is read from; before two such periods, predictions stand.
MIN_SAMPLES = 10
# Samples older than this describe no queue of now, however few the newer ones.
HORIZON_S = 60.0
# A correction beyond this says the step model is wrong, not imprecise: shedding twice as early is the limit.
MAX_FACTOR = 2.0
# At most this many samples are kept (the last ones): two periods and the gap at up to ~340 relevant requests a
# second through one router process.
WINDOW = 4096
# With many samples a period, the factor is recomputed every (recent period's samples / this) samples: a quantile
# over hundreds moves little with one more, and each recompute reads the whole window.
SAMPLES_PER_REFIT = 64


@dataclass(slots=True)
class PredictionError:
    """Measured over predicted TTFT of recent served requests; `factor(now)` scales admission's predictions."""

    quantile: float = 0.99  # 0: off (the factor stays 1)
    _samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))  # (time, ratio)
    _factor: float = 1.0
    _last_at: float = float("-inf")
    _recent_n: int = 0  # the last period's samples at the last recompute
    _since_refit: int = 0

    def observe(self, now: float, measured_s: float, predicted_s: float | None, target_s: float | None) -> None:
        """One served request's first token: `measured_s` against the `predicted_s` its placement was admitted on."""
        if self.quantile <= 0 or predicted_s is None or predicted_s <= 0 or target_s is None:
            return
        if max(predicted_s, measured_s) < RELEVANT_SHARE * target_s:
            return
        samples = self._samples
        samples.append((now, measured_s / predicted_s))
        while samples and samples[0][0] < now - HORIZON_S:
            samples.popleft()
        self._last_at = now
        self._since_refit += 1
        if self._since_refit >= self._recent_n // SAMPLES_PER_REFIT:
            self._since_refit = 0
            self._factor = self._shown_twice(now)

    def _shown_twice(self, now: float) -> float:
        """The smaller of the quantiles over the last period and the period before it, `GAP_S` apart (1: fewer
        than two periods' samples)."""
        times = [t for t, _ in self._samples]
        recent = self._period_start(times, len(times), now)
        self._recent_n = len(times) - recent if recent >= 0 else 0
        if recent < 0:
            return 1.0
        before = bisect_left(times, times[recent] - GAP_S)  # the earlier period ends before this index
        earlier = self._period_start(times, before, times[before - 1]) if before else -1
        if earlier < 0:
            return 1.0
        ratios = [r for _, r in self._samples]
        shown = min(self._at_quantile(ratios[recent:]), self._at_quantile(ratios[earlier:before]))
        return min(MAX_FACTOR, max(1.0, shown))

    @staticmethod
    def _period_start(times: list[float], end: int, last: float) -> int:
        """The first index of the period ending at index `end` (exclusive), whose last sample is at `last`: at
        least `PERIOD_S` long and `MIN_SAMPLES` samples; -1 where fewer are left."""
        start = min(bisect_left(times, last - PERIOD_S, 0, end), end - MIN_SAMPLES)
        return start if start >= 0 else -1

    def _at_quantile(self, ratios: list[float]) -> float:
        ratios = sorted(ratios)
        return ratios[min(len(ratios) - 1, int(self.quantile * len(ratios)))]

    def factor(self, now: float) -> float:
        """What admission multiplies a prediction by now (1: as predicted)."""
        return self._factor if now - self._last_at <= PERIOD_S else 1.0
