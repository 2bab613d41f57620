"""The engine's prefill rate, measured online: prompt tokens computed per second while prompts were queued.

The router sizes its admission queue from it (router/admission.py: a worker may hold as many queued prompt
tokens as it prefills within the TTFT target), so the limit follows the hardware and the model instead of a
constant reasoned for one of them. Unlike the scheduler's device-timed prefill speed, this is wall time with
decode steps in between: how fast a queue of prompts actually drains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sched.prefill_budget import PrefillSpeed


@dataclass
class PrefillRate:
    smoothing: float = 0.3  # weight of the newest interval
    _speed: PrefillSpeed = field(init=False)
    _last_t: float | None = None
    _last_tokens: int = 0
    _was_busy: bool = False

    def __post_init__(self) -> None:
        self._speed = PrefillSpeed(self.smoothing)

    @property
    def tokens_per_s(self) -> float:
        return self._speed.tokens_per_s

    def observe(self, now: float, tokens_total: int, busy: bool) -> float:
        """`tokens_total`: prompt tokens computed so far; `busy`: prompt tokens are queued now. An interval
        counts only when prompts were queued at both of its ends (an idle engine says nothing of its rate)."""
        if self._last_t is not None and busy and self._was_busy and now > self._last_t:
            self._speed.observe(tokens_total - self._last_tokens, now - self._last_t, allow_zero=True)
        self._last_t, self._last_tokens, self._was_busy = now, tokens_total, busy
        return self.tokens_per_s
