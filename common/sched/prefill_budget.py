"""How many prompt tokens a step may take beside the requests it decodes (stall-free batching).

Every step carries one token for every running request; prompt chunks ride along up to a token budget. The
budget follows an ITL target T: the step that carries a chunk is the gap between two of every running
request's tokens, and it costs about the decode step D it replaces plus its chunk, so the chunk is what the
engine prefills in T - D at its peak device-timed prefill speed (the fastest chunk tokens per second of any
prefill or mixed step so far: a large chunk's, where fixed costs are amortised, so a few short prompts
prefilled alone do not lower it). On the GPU prefill and mixed steps run as piecewise CUDA graphs
(common/engine/gpu/step_graphs.py), so a mixed step is a decode step plus its chunk's compute; eagerly, an 8B
step's launch alone cost ~15 ms on the H200 whatever its chunk, and a budget fed back from the mixed steps'
own times shrank to its floor (bench/RESULTS.md "Stall-free batching").

The target is by default `AUTO_ITL_DECODE_STEPS` of the engine's own decode step (device-timed, smoothed), so
it follows the model, the hardware and the batch size without tuning; `itl_target_ms > 0` sets it in
milliseconds; 0 turns mixed steps off (prefill-first: a waiting prompt's chunks run back to back, each taking
`max_prefill_tokens`, and decoding waits for them; kept for A/B runs). Steps without decoding requests take
the whole `max_prefill_tokens`.

No starvation: the budget never falls below MIN_PAGES pages, so a waiting prompt progresses every step even
when the target leaves no room (a decode step that alone exceeds it). Nor does the ITL target starve the queue:
when the prompt tokens queued behind the prompt being prefilled (the backlog: one long prompt alone has
none) exceed BACKLOG_STEPS chunks, the chunk grows to a 1/BACKLOG_STEPS share of the backlog (at most
`max_prefill_tokens`), so prefill keeps up with arrivals and a saturated worker runs full chunks with its
decode rows riding along.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_PAGES = 4  # the budget never falls below this many pages: tiny chunks would starve prompts altogether
# The auto ITL target in decode steps: a step beside decoding takes about this many decode steps, its chunk one
# decode step's worth of prefill (bench/RESULTS.md, "Stall-free batching": on the H200, 8B, chunks of ~200-
# 750 tokens at batch 1-64, inside the 2.5x bound of low load; the backlog rule takes over where arrivals
# outpace that). On the CPU (2 threads) it gives chunks of ~50 tokens.
AUTO_ITL_DECODE_STEPS = 2.0
# A backlog of waiting prompt tokens is cleared in about this many steps at most: past BACKLOG_STEPS ITL chunks,
# the chunk is the backlog's share instead (queue pressure beats the ITL target, else TTFT grows without bound).
BACKLOG_STEPS = 2


def prefill_token_budget(
    max_tokens: int,
    page_size: int,
    tokens_per_s: float,
    itl_target_s: float,
    decoding: bool,
    backlog_tokens: int = 0,
    decode_step_s: float = 0.0,
) -> int:
    """`max_tokens`, or while requests decode (and the target and speed are known) the tokens prefilled in
    what the target leaves beside the decode step (`itl_target_s - decode_step_s`) or, if larger, a
    BACKLOG_STEPS share of the `backlog_tokens` waiting; whole pages, at least MIN_PAGES pages."""
    if not decoding or itl_target_s <= 0 or tokens_per_s <= 0:
        return max_tokens
    room_s = max(itl_target_s - decode_step_s, 0.0)
    tokens = max(int(tokens_per_s * room_s), backlog_tokens // BACKLOG_STEPS)
    return min(max_tokens, max(MIN_PAGES * page_size, tokens // page_size * page_size))


@dataclass
class PrefillSpeed:
    """Prompt tokens per second, smoothed (an exponential moving average) over the intervals observed."""

    smoothing: float = 0.2
    tokens_per_s: float = 0.0
    peak_tokens_per_s: float = 0.0  # the fastest interval (the budget's speed: one model on one device)

    def observe(self, tokens: int, seconds: float, allow_zero: bool = False) -> None:
        """One interval's tokens and seconds; `allow_zero`: an interval that computed nothing is a sample
        too (a stalled queue), not a missing one."""
        if seconds <= 0 or tokens < 0 or (tokens == 0 and not allow_zero):
            return
        sample = tokens / seconds
        self.peak_tokens_per_s = max(self.peak_tokens_per_s, sample)
        if self.tokens_per_s <= 0:
            self.tokens_per_s = sample
        else:
            self.tokens_per_s += self.smoothing * (sample - self.tokens_per_s)


@dataclass
class StepSeconds:
    """A step's duration, smoothed (exponential moving average; 0 until the first step is observed)."""

    smoothing: float = 0.2
    seconds: float = 0.0

    def observe(self, seconds: float) -> None:
        if seconds <= 0:
            return
        self.seconds = seconds if self.seconds <= 0 else self.seconds + self.smoothing * (seconds - self.seconds)
