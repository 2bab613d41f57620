"""The engine's prefill rate, measured online: prompt tokens computed per second while prompts were queued.

The router sizes its admission queue from it (router/admission.py: a worker may hold as many queued prompt
tokens as it prefills within the TTFT target), so the limit follows the hardware and the model instead of a
constant reasoned for one of them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillRate:
    smoothing: float = 0.3  # weight of the newest interval
    tokens_per_s: float = 0.0
    _last_t: float | None = None
    _last_tokens: int = 0
    _was_busy: bool = False

    def observe(self, now: float, tokens_total: int, busy: bool) -> float:
        """`tokens_total`: prompt tokens computed so far; `busy`: prompt tokens are queued now. An interval
        counts only when prompts were queued at both of its ends (an idle engine says nothing of its rate)."""
        if self._last_t is not None and busy and self._was_busy and now > self._last_t:
            sample = (tokens_total - self._last_tokens) / (now - self._last_t)
            if self.tokens_per_s <= 0:
                self.tokens_per_s = sample
            else:
                self.tokens_per_s += self.smoothing * (sample - self.tokens_per_s)
        self._last_t, self._last_tokens, self._was_busy = now, tokens_total, busy
        return self.tokens_per_s
