"""What sizes a simulated fleet: the planner (planner/core.py, fed the way planner/source.py feeds it), or one
Kubernetes HPA per role on utilisation (the HPA's own algorithm: desired = ceil(replicas x utilisation /
target), a 10% tolerance, scale-down to the highest recommendation of the last five minutes)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from bench.fleet_sim.fleet import Fleet
from planner.core import Decision, Planner
from planner.observe import Totals, observation, queue_wait_s, trim_window
from planner.sizing import Counts, OfferedLoad

__all__ = ["HpaController", "PlannerController"]


@dataclass
class PlannerController:
    planner: Planner
    fallback: OfferedLoad
    window_s: float = 30.0  # the rate and lengths are read over this long (the queue wait is instant)
    decisions: list[Decision] = field(default_factory=list)
    _totals: deque[Totals] = field(default_factory=deque)

    @property
    def interval_s(self) -> float:
        return self.planner.cfg.interval_s

    def tick(self, fleet: Fleet, now: float) -> Counts | None:
        now_totals = replace(fleet.totals, t=now)
        self._totals.append(now_totals)
        trim_window(self._totals, now, self.window_s)
        if len(self._totals) < 2:
            return None  # as planner/main.py: no decision before a second reading gives the window a length
        before = self._totals[0]
        # the instant figures: the queue wait over the workers that prefill, and the replicas ready now
        roles = ("prefill",) if any(w.role == "prefill" for w in fleet.sims.values()) else ("decode", "mixed")
        queues = []
        for w in fleet.sims.values():
            if w.role in roles and not w.draining:
                load = w.load(now)
                queues.append((load.queued_prefill_tokens, load.prefill_tokens_per_s))
        obs = observation(before, now_totals, queue_wait_s(queues), fleet.counts(include_starting=False), self.fallback)
        decision = self.planner.decide(obs)
        self.decisions.append(decision)
        fleet.timeline.append(
            {
                "t": now,
                "rate": obs.load.rate,
                "queue_wait_s": obs.queue_wait_s,
                "ready": fleet.counts(include_starting=False).__dict__,
                "targets": decision.targets.__dict__,
            }
        )
        return decision.targets


@dataclass
class HpaController:
    target: float = 0.7  # utilisation each role is held at
    interval_s: float = 15.0
    stabilisation_s: float = 300.0
    tolerance: float = 0.1
    min_replicas: int = 1
    _busy: dict[str, float] = field(default_factory=dict)
    _last: float = 0.0
    _recs: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)

    def tick(self, fleet: Fleet, now: float) -> Counts | None:
        dt = now - self._last
        self._last = now
        busy: dict[str, float] = {}
        n: dict[str, int] = {}
        for w in fleet.sims.values():
            if w.draining:
                continue
            # busy time so far, counting the step in flight up to now (what a utilisation gauge reads)
            b = w.busy_s + (max(0.0, now - w.span_start) if w.busy_until >= 0 else 0.0)
            busy[w.role] = busy.get(w.role, 0.0) + b - self._busy.get(w.name, 0.0)
            self._busy[w.name] = b
            n[w.role] = n.get(w.role, 0) + 1
        if dt <= 0:
            return None
        have = fleet.counts()
        out = {}
        for role in ("prefill", "decode", "mixed"):
            current = getattr(have, role)
            if current == 0:
                out[role] = 0
                continue
            util = busy.get(role, 0.0) / (dt * max(n.get(role, 1), 1))
            ratio = util / self.target
            desired = (
                current if abs(ratio - 1) <= self.tolerance else max(self.min_replicas, math.ceil(current * ratio))
            )
            recs = self._recs.setdefault(role, deque())
            recs.append((now, desired))
            while recs and now - recs[0][0] > self.stabilisation_s:
                recs.popleft()
            out[role] = desired if desired > current else max(r for _, r in recs)
        fleet.timeline.append({"t": now, "targets": out, "ready": fleet.counts(include_starting=False).__dict__})
        return Counts(**out)
