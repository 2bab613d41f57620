"""What the planner reads, reduced to an Observation the same way from the router's HTTP endpoints or the fleet
simulator's router. Every arrival is offered load; the queue wait is the least predicted wait over the workers
that prefill (where a request arriving now would go).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from planner.core import Observation
from planner.sizing import Counts, OfferedLoad

__all__ = ["Totals", "observation", "queue_wait_s", "trim_window"]


@dataclass(frozen=True)
class Totals:
    t: float
    requests: float = 0.0  # arrivals
    served: float = 0.0  # requests whose lengths are in the sums below
    prompt_tokens: float = 0.0
    prompt_sq_tokens: float = 0.0  # sum of squared prompt lengths (0: unknown)
    output_tokens: float = 0.0
    cached_tokens: float = 0.0
    shed: float = 0.0


def trim_window(history: deque[Totals], now: float, window_s: float) -> None:
    """Drops the readings the rate no longer needs, keeping the newest one at least `window_s` old: the rate is
    read over at least the window. Dropping every reading older than the window read it over one interval less
    whenever readings came a hair over an interval apart, as a live planner's do (the H100 dry run's 30 s window
    read its rates over 25 s, 9-18% above the 30 s figure in the step's first 25 s, and sized a pod more than the
    simulator, whose readings fall on the grid, at every change)."""
    while len(history) > 1 and now - history[1].t >= window_s:
        history.popleft()


def queue_wait_s(queues: Iterable[tuple[float, float]]) -> float:
    """The least wait over the prefilling workers, (queued prompt tokens, tokens/s) each; unmeasured ones left out."""
    waits = [q / r for q, r in queues if r > 0]
    return min(waits, default=0.0)


def observation(before: Totals, now: Totals, queue_wait: float, ready: Counts, fallback: OfferedLoad) -> Observation:
    dt = max(now.t - before.t, 1e-9)
    served = now.served - before.served
    prompt = (now.prompt_tokens - before.prompt_tokens) / served if served > 0 else fallback.prompt
    output = (now.output_tokens - before.output_tokens) / served if served > 0 else fallback.output
    cached = now.cached_tokens - before.cached_tokens
    total_prompt = now.prompt_tokens - before.prompt_tokens
    hit = cached / total_prompt if total_prompt > 0 else fallback.prefix_hit
    sq = (now.prompt_sq_tokens - before.prompt_sq_tokens) / served if served > 0 else fallback.prompt_sq
    load = OfferedLoad((now.requests - before.requests) / dt, prompt, output, hit, sq)
    return Observation(now.t, load, queue_wait, (now.shed - before.shed) / dt, ready)
