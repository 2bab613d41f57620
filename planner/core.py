"""The planner's decisions: from one ``Observation`` every ``interval_s``, the replica counts each Deployment
should have (docs/architecture.md, "The planner"): a Holt forecast one pod start-up ahead (held within
``max_growth`` of the level), sized by planner/sizing.py, raised when the predicted queue wait passes the alarm
(from the replicas ready now, so starting pods are not counted twice) or, below it, is far likelier with the
reserve's step landed than at the rate seen (the step's first sign, before the rate window shows it), never below
a reserve that absorbs a step of the load while new pods start (``step_reserve``, a step of the baseline load
landing on the load now), and hysteresis on the way down.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field, replace

from planner.sizing import Counts, FleetSpec, OfferedLoad, reserve_fleet, size_fleet, wait_chance

__all__ = ["Decision", "Observation", "Planner", "PlannerConfig", "RateForecast"]

ROLES = ("prefill", "decode", "mixed")

# How much likelier a reading's non-zero queue wait must be with the reserve's step landed than at the rate seen
# before the planner takes it for the step (``Planner._step_under_way``): a likelihood ratio of 10, the threshold of
# "strong" evidence on Jeffreys' scale of Bayes factors. One reading is all a step gives before the rate window
# catches up: with the reserve up, the queue shows once or twice and drains (Mooncake at 2x and 6x: one reading
# each in the burst's first 40 s). Not a wide margin on the evaluation's traces (bench/RESULTS.md, "A short queue
# taken for the step"): their bursts' first non-zero readings came at ratios of 15.7-146, readings above the
# baseline outside the bursts at up to 9.8; at 5 Azure at 32x raised a pod before its burst (1.154x the fixed
# split's GPU-hours), at 20 Mooncake at 2x and Azure at 32x waited 20-25 s again.
STEP_EVIDENCE = 10.0


@dataclass(frozen=True)
class Observation:
    t: float  # seconds (any clock that only moves forward)
    load: OfferedLoad  # arrival rate and mean lengths over the last window
    queue_wait_s: float = 0.0  # predicted wait of a request arriving now, before its own prefill starts
    shed_rate: float = 0.0  # requests/s refused (429) for TTFT or admission limits
    ready: Counts = field(default_factory=Counts)  # replicas ready now


@dataclass(frozen=True)
class PlannerConfig:
    interval_s: float = 5.0
    horizon_s: float = 60.0  # how far ahead to forecast: a new pod's time to ready
    queue_alarm: float = 0.5  # share of the TTFT target a queue wait may reach before the plan is raised
    drain_s: float = 30.0  # a backlog is to be drained within this long
    max_step_up: float = 2.0  # at most this factor of the ready replicas per reaction to a queue
    max_growth: float = 1.0  # the forecast stays within (1 + this) x the smoothed rate
    up_cooldown_s: float = 10.0
    down_cooldown_s: float = 60.0
    down_stable_s: float = 60.0
    down_band: float = 0.1
    down_step: float = 0.25
    trend_alpha: float = 0.5  # Holt's smoothing of the level
    trend_beta: float = 0.2  # ... and of the trend
    # The fleet keeps up with a step of (1 + this) x the baseline load with the pods it already has: a step
    # faster than a pod start (horizon_s) is met by what runs, however soon the plan reacts (0: no reserve).
    step_reserve: float = 0.0
    # The baseline the reserve is sized from: the load smoothed over this long, so that a burst of a minute or
    # two does not raise the reserve for a second step on top of itself.
    baseline_s: float = 300.0


@dataclass
class RateForecast:
    alpha: float
    beta: float
    level: float | None = None
    trend: float = 0.0  # requests/s per sample

    def update(self, rate: float) -> None:
        if self.level is None:
            self.level = rate
            return
        previous = self.level
        self.level = self.alpha * rate + (1 - self.alpha) * (previous + self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend

    def ahead(self, samples: float, max_growth: float) -> float:
        level = self.level or 0.0
        return min(max(0.0, level + self.trend * samples), level * (1 + max_growth))


@dataclass(frozen=True)
class Decision:
    t: float
    targets: Counts  # replicas each role should have
    planned: Counts  # what the model sized for the forecast load, before hysteresis
    forecast_rate: float
    reasons: dict[str, str]  # role -> why it changed ("" if it did not)

    @property
    def changed(self) -> bool:
        return any(self.reasons.values())


@dataclass
class Planner:
    spec: FleetSpec
    cfg: PlannerConfig = field(default_factory=PlannerConfig)
    targets: Counts | None = None  # what it last asked for (None: not yet; the first observation's ready)
    _forecast: RateForecast | None = None
    _baseline: OfferedLoad | None = None  # the smoothed lengths with the median rate (``_reserve``)
    _baseline_t: float = 0.0
    _smoothed: OfferedLoad | None = None  # every figure of the load, smoothed over baseline_s
    _smoothed_s: float = 0.0  # seconds of load the smoothing has seen
    _rates: deque[tuple[float, float]] = field(default_factory=deque)  # (t, rate) read over the last baseline_s
    _last_change: dict[str, float] = field(default_factory=dict)
    _low_since: dict[str, float] = field(default_factory=dict)
    _recent: deque[Decision] = field(default_factory=lambda: deque(maxlen=720))

    def decide(self, obs: Observation) -> Decision:
        cfg = self.cfg
        if self._forecast is None:
            self._forecast = RateForecast(cfg.trend_alpha, cfg.trend_beta)
        self._forecast.update(obs.load.rate)
        ahead = self._forecast.ahead(cfg.horizon_s / cfg.interval_s, cfg.max_growth)
        # The rate counts every arrival, those refused included (planner/observe.py): the shed are in it already.
        rate = max(obs.load.rate, ahead)
        planned = self._reserve(obs, self._sized(obs, rate))
        planned = self._queue_reaction(obs, planned)
        current = self.targets if self.targets is not None else obs.ready
        targets, reasons = {}, {}
        for role in ROLES:
            targets[role], reasons[role] = self._hysteresis(role, getattr(current, role), getattr(planned, role), obs.t)
        self.targets = Counts(**targets)
        decision = Decision(obs.t, self.targets, planned, rate, reasons)
        self._recent.append(decision)
        return decision

    def _sized(self, obs: Observation, rate: float) -> Counts:
        """The fleet for the forecast `rate`. Without a reserve: ``size_fleet``'s margins, for a load held for
        good. With one and a quiet queue, what keeps up with the load (``reserve_fleet``): the reserve (twice the
        baseline at ``step_reserve`` 1) already holds more than ``size_fleet``'s margins for the baseline, a load
        that lasts raises the baseline within ``baseline_s``, and a queue or shed requests still raise the plan
        (``_queue_reaction``). While the rate seen stays within the reserve's step, it is sized on that rate, not
        on the forecast: a step reads as a ramp for one window of the rate, which Holt's trend carries one
        start-up ahead, up to twice the step (Mooncake at 8x: 67 req/s forecast where 53 came, pods asked for a
        step the reserve was riding). Past the step, the forecast: the load outruns what is held for it."""
        b, cfg = self._baseline, self.cfg
        load = replace(obs.load, rate=rate)
        if cfg.step_reserve > 0 and b is not None and obs.queue_wait_s <= cfg.queue_alarm * self.spec.ttft_s:
            seen = obs.load.rate
            if seen <= b.rate * (1 + cfg.step_reserve):
                return reserve_fleet(self.spec, replace(obs.load, rate=seen))
            return reserve_fleet(self.spec, load)
        return size_fleet(self.spec, load)

    def _reserve(self, obs: Observation, planned: Counts) -> Counts:
        """Raises the plan to what must run when a step of ``step_reserve`` x the baseline rate comes: the step
        lands on the load of that moment (the forecast's level, at most the baseline: a load above it is a step
        already under way, which the plan sizes itself, and a reserve on top of it would stack one step on
        another), and its requests find no prefix cached (``reserve_fleet``)."""
        cfg = self.cfg
        load = obs.load
        if self._smoothed is None:
            self._smoothed = load
            self._smoothed_s = cfg.interval_s  # the first reading stands for one interval's load
        else:
            # The lengths and prefix hits, smoothed: one window's mean prompt swings with a heavy tail. Until
            # baseline_s of load has been seen, the plain mean of the readings (each weighted by its interval):
            # smoothing from the first reading alone kept its weight for minutes (e^-1 of it after baseline_s),
            # and a planner's first minute is not its typical one (Mooncake at 8x: cold caches, 3% prefix hits
            # where 20% followed, and longer prompts), so the reserve followed one reading for the whole run.
            dt = max(obs.t - self._baseline_t, 0.0)
            self._smoothed_s += dt
            new = max(1.0 - math.exp(-dt / cfg.baseline_s), dt / self._smoothed_s)
            b = self._smoothed
            self._smoothed = OfferedLoad(
                *((1 - new) * getattr(b, f) + new * getattr(load, f) for f in OfferedLoad.__dataclass_fields__)
            )
        # The rate: the median of the readings of the last baseline_s. A burst that lifts fewer than half of them
        # (two minutes, plus the rate window's length, within five) leaves it where it was, so the reserve is
        # neither stacked on the burst nor held up for minutes after it, where a mean took a third of a two-minute
        # doubling and kept it for baseline_s; a change that lasts moves it within half of baseline_s, where a
        # mean lags a steady rise by all of baseline_s.
        self._rates.append((obs.t, load.rate))
        while self._rates and self._rates[0][0] <= obs.t - cfg.baseline_s:
            self._rates.popleft()
        self._baseline = replace(self._smoothed, rate=statistics.median(r for _, r in self._rates))
        self._baseline_t = obs.t
        if cfg.step_reserve <= 0:
            return planned
        need = reserve_fleet(self.spec, *self._step_load())
        return Counts(max(planned.prefill, need.prefill), max(planned.decode, need.decode), planned.mixed)

    def _step_load(self) -> tuple[OfferedLoad, float]:
        """The load the reserve's step lands on (the forecast's level, at most the baseline) and the step's rate."""
        b = self._baseline
        assert b is not None  # set by ``_reserve`` before any caller
        now = self._forecast.level if self._forecast is not None and self._forecast.level is not None else b.rate
        return replace(b, rate=min(now, b.rate)), self.cfg.step_reserve * b.rate

    def _queue_reaction(self, obs: Observation, planned: Counts) -> Counts:
        cfg = self.cfg
        alarm = cfg.queue_alarm * self.spec.ttft_s
        # Shedding within the share of requests the SLO lets miss (1 - its percentile) is no call for more pods:
        # the router also refuses a prompt too long for any worker to prefill within the target even idle
        # (Mooncake's longest, a few a minute), whatever the fleet, and each such refusal raised the plan by a pod
        # and restarted the wait before any scale-down (Mooncake at 12x: eight such raises of one prefill pod in
        # 900 s with no queue, 37 -> 39 before its burst and 43 -> 46 after it).
        shedding = obs.shed_rate > (1 - self.spec.percentile / 100) * obs.load.rate
        backlog = obs.queue_wait_s > alarm or self._step_under_way(obs)
        if not backlog and not shedding:
            return planned
        role = "prefill" if "prefill" in self.spec.roles and obs.ready.prefill > 0 else "mixed"
        if role not in self.spec.roles:
            return planned
        ready = getattr(obs.ready, role)
        extra = ready * obs.queue_wait_s / cfg.drain_s if backlog else 0.0
        if shedding and obs.load.rate > 0:
            extra += ready * obs.shed_rate / obs.load.rate
        wanted = min(max(ready + max(1, math.ceil(extra)), getattr(planned, role)), math.ceil(ready * cfg.max_step_up))
        wanted = max(wanted, getattr(planned, role))
        return replace(planned, **{role: min(wanted, getattr(self.spec.max_workers, role))})

    def _step_under_way(self, obs: Observation) -> bool:
        """Whether a non-zero queue wait below the alarm is the reserve's step arriving, before the rate shows it.

        A reading's wait is above 0 when every prefill worker is busy, which at the rate seen with the ready workers
        has Erlang's C chance (``wait_chance``; the readings outside the evaluation's bursts match it: 16% of
        Azure's at 4x against 19% predicted, none of Mooncake's against 0-0.2%). The rate is read over a window
        (30 s in the simulator) that takes in a sixth of a step per 5 s reading, and the reserve carries the step
        with a short queue, so the wait stays under the alarm (0.01-0.17 s of 2 s at Mooncake's bursts' first
        non-zero readings) and the plan waited 30-35 s for the rate. So the wait is taken for the step where it is
        at least ``STEP_EVIDENCE`` times likelier at the load the reserve is held for (the step on the load now,
        ``_step_load``) than at the rate seen. On a few busy workers a non-zero wait is routine at both (Azure's 2-4
        prefill workers: ratios of 1-7), so it is left to the alarm; on many workers with the reserve idle it is
        rare at the rate seen (ratios of 15.7-146 at the bursts' first non-zero readings, 10-27 prefill workers).

        And only while the rate seen is above the baseline (the dead-band): a step lifts it within one reading, and
        a queue at a quieter time is the load's own noise (a run of long prompts), which the reserve held for a
        whole step absorbs, and a pod raised for it would be taken back a minute or two later.
        """
        cfg, b, spec = self.cfg, self._baseline, self.spec
        workers = obs.ready.prefill
        if cfg.step_reserve <= 0 or b is None or obs.queue_wait_s <= 0 or workers <= 0 or "prefill" not in spec.roles:
            return False
        seen = obs.load.rate
        if seen <= b.rate:
            return False
        at_seen = wait_chance(spec, replace(b, rate=seen), workers)
        base, step = self._step_load()
        return wait_chance(spec, base, workers, step) >= STEP_EVIDENCE * at_seen

    def _hysteresis(self, role: str, current: int, planned: int, t: float) -> tuple[int, str]:
        cfg = self.cfg
        since_change = t - self._last_change.get(role, -math.inf)
        if planned > current:
            self._low_since.pop(role, None)
            if since_change < cfg.up_cooldown_s:
                return current, ""
            self._last_change[role] = t
            return planned, f"up {current}->{planned}"
        if planned >= current * (1 - cfg.down_band) or planned == current:
            self._low_since.pop(role, None)
            return current, ""
        low_since = self._low_since.setdefault(role, t)
        if t - low_since < cfg.down_stable_s or since_change < cfg.down_cooldown_s:
            return current, ""
        target = max(planned, math.floor(current * (1 - cfg.down_step)), 0)
        if target >= current:
            return current, ""
        self._last_change[role] = t
        self._low_since.pop(role, None)
        return target, f"down {current}->{target}"
