"""How many prompt tokens a prefill step may take while other requests are decoding.

A prefill step holds up every running request's next token for as long as it runs: a 2,048-token chunk of
an 8B model is ~50 ms on an H200 against a ~6-16 ms decode step, which is what put aggregated ITL p99 at
34-120 ms (bench/RESULTS.md). With an ITL target set, a prefill step that runs beside decoding requests is
capped at the tokens the engine prefills in that long, at its own device-timed prefill speed (so the cap
follows the model and the hardware); alone, a prefill step takes the whole `max_prefill_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_PAGES = 4  # the cap never falls below this many pages: tiny chunks would starve prompts altogether


def prefill_token_budget(
    max_tokens: int, page_size: int, tokens_per_s: float, itl_target_s: float, decoding: bool
) -> int:
    """`max_tokens`, or while requests decode (and the target and speed are known) the tokens prefilled in
    `itl_target_s`, whole pages, at least MIN_PAGES pages."""
    if not decoding or itl_target_s <= 0 or tokens_per_s <= 0:
        return max_tokens
    capped = int(tokens_per_s * itl_target_s) // page_size * page_size
    return min(max_tokens, max(MIN_PAGES * page_size, capped))


@dataclass
class PrefillSpeed:
    """Prompt tokens per second, smoothed (an exponential moving average) over the intervals observed."""

    smoothing: float = 0.2
    tokens_per_s: float = 0.0

    def observe(self, tokens: int, seconds: float, allow_zero: bool = False) -> None:
        """One interval's tokens and seconds; `allow_zero`: an interval that computed nothing is a sample
        too (a stalled queue), not a missing one."""
        if seconds <= 0 or tokens < 0 or (tokens == 0 and not allow_zero):
            return
        sample = tokens / seconds
        if self.tokens_per_s <= 0:
            self.tokens_per_s = sample
        else:
            self.tokens_per_s += self.smoothing * (sample - self.tokens_per_s)
