"""What one worker can do, from the step-time model's seconds per unit of work (``step_coefficients``): prefill
rates, decode step times and the batch a step-time target allows. The one copy of the formulas, read by the
scheduler, the router's TTFT prediction, the planner and the fleet simulator:

    step = base + per_prefill_token * prefill_tokens + per_decode_row * rows + per_context_token * context
         + per_attention_pair * chunk_attention      (a chunk's query-key pairs: n * (start + n / 2))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["StepCost", "chunk_attention", "largest_fitting", "prompt_steps_s"]

GUESS_STEPS = 4  # single steps from a guess before bisection takes over (a good guess is off by at most one)


def chunk_attention(start: int, tokens: int) -> float:
    return tokens * (start + tokens / 2)


def largest_fitting(fits: Callable[[int], bool], most: int, guess: int | None = None) -> int:
    """The largest u in [0, most] with fits(u), for a monotone `fits` (bisection); 0 when not even 1 fits.
    `guess`: an estimate of u (a closed form's), searched from by single steps first: the same answer, in two
    or three calls of `fits` where bisection takes log2(most)."""
    if most <= 0 or not fits(1):
        return 0
    if guess is not None:
        u = min(max(guess, 1), most)
        for _ in range(GUESS_STEPS):
            if not fits(u):
                u -= 1  # >= 1: fits(1) holds
            elif u == most or not fits(u + 1):
                return u
            else:
                u += 1
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class StepCost:
    """Seconds per unit of what a step computes (/load's ``step_coefficients``)."""

    base_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_decode_row_s: float = 0.0
    per_context_token_s: float = 0.0
    per_attention_pair_s: float = 0.0

    @classmethod
    def from_map(cls, m: Mapping[str, float]) -> StepCost:
        return cls(**{k: float(m.get(k, 0.0)) for k in cls.__dataclass_fields__})

    def as_map(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in self.__dataclass_fields__}

    @property
    def known(self) -> bool:
        return self.per_prefill_token_s > 0

    def overhead_s(self, rows: int, context: int) -> float:
        """What every step costs whatever its chunk: the base and the decode batch (never < 0)."""
        return max(0.0, self.base_s + self.per_decode_row_s * rows + self.per_context_token_s * context)

    def step_s(self, prefill_tokens: int, rows: int, context: int, attention: float = 0.0) -> float:
        """One step's time: `prefill_tokens` (their pairs `attention`) beside `rows` rows over `context` tokens."""
        return self.chunk_step_s(self.overhead_s(rows, context), prefill_tokens, attention)

    def chunk_step_s(self, overhead_s: float, prefill_tokens: int, attention: float = 0.0) -> float:
        """`step_s` from its batch's `overhead_s` (what `overhead_s` gives it): for several chunks beside one batch,
        the batch's part computed once."""
        return overhead_s + self.per_prefill_token_s * prefill_tokens + self.per_attention_pair_s * attention

    def prefill_rate(self, chunk: int, rows: int = 0, context: int = 0) -> float:
        """Prompt tokens per second at `chunk` tokens a step beside `rows` decode rows (0: not measured)."""
        if not self.known or chunk <= 0:
            return 0.0
        return chunk / self.step_s(chunk, rows, context, chunk * chunk / 2)

    def largest_chunk(self, target_s: float, rows: int, context: int, start: int, most: int, granularity: int) -> int:
        """The most prompt tokens (a multiple of `granularity`, at most `most`) a step may take within `target_s`."""
        if not self.known:
            return 0
        overhead = self.overhead_s(rows, context)

        def fits(units: int) -> bool:
            n = units * granularity
            return self.chunk_step_s(overhead, n, chunk_attention(start, n)) <= target_s

        guess = self._chunk_guess(target_s, overhead, start, most)
        units = largest_fitting(fits, most // granularity, None if guess is None else guess // granularity)
        return units * granularity

    def _chunk_guess(self, target_s: float, overhead_s: float, start: int, most: int) -> int | None:
        """Where `largest_chunk`'s search starts, in tokens: the root of the step time's quadratic in the chunk n,
        `overhead_s` + (per_prefill_token + per_attention_pair * start) n + per_attention_pair n^2 / 2 = target
        (None where a negative coefficient could make the step time fall as n grows)."""
        a = self.per_attention_pair_s / 2
        b = self.per_prefill_token_s + self.per_attention_pair_s * start
        if a < 0 or self.per_prefill_token_s < 0 or start < 0:
            return None
        room = target_s - overhead_s
        if room <= 0:
            return 0
        if a > 0:
            n = 2 * room / (b + math.sqrt(b * b + 4 * a * room))  # the root's cancellation-free form
        elif b > 0:
            n = room / b
        else:
            return most
        return int(min(n, most))

    def decode_rows_within(self, target_s: float, context_per_row: float, most: int) -> int:
        """The most decode rows one step carries within `target_s` with no chunk beside it."""
        return largest_fitting(lambda r: self.overhead_s(r, int(r * context_per_row)) <= target_s, most)


def prompt_steps_s(cost: StepCost, prompt: int, chunk: int, rows: int = 0, context: int = 0) -> float:
    """Seconds to prefill one `prompt` alone, `chunk` tokens a step, beside `rows` decode rows."""
    if prompt <= 0:
        return 0.0
    chunk = max(1, min(chunk, prompt)) if chunk > 0 else prompt
    steps = math.ceil(prompt / chunk)
    return (
        steps * cost.overhead_s(rows, context)
        + cost.per_prefill_token_s * prompt
        + cost.per_attention_pair_s * prompt * prompt / 2
    )
