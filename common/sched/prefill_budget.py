"""How many prompt tokens a step may take beside the requests it decodes (stall-free batching,
docs/architecture.md): the largest chunk whose step the step-time model predicts within the ITL target, so
running requests keep their ITL while prompts prefill as fast as it allows.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.sched.step_model import StepTimeModel

MIN_PAGES = 4  # the budget never falls below this many pages: tiny chunks would starve prompts altogether
# The SLO target never falls under this many decode steps: below, prompts would prefill in MIN_PAGES slivers.
FLOOR_DECODE_STEPS = 2.0


@dataclass(frozen=True)
class StepContext:
    decode_rows: int = 0
    decode_context: int = 0
    chunk_start: int = 0  # where the next chunk starts in its prompt (its attention reads that prefix)


class BudgetReason:
    """What sized a step's prompt-token budget (named in the step plan)."""

    ITL_TARGET = "itl_target"  # the largest chunk predicted within the ITL target beside the decode rows
    MAX_STEP = "max_step"  # the largest chunk predicted within KVFERRY_MAX_STEP_MS
    MAX_PREFILL_TOKENS = "max_prefill_tokens"  # the cap itself (no target applies, or the target allows more)
    MIN_PAGES = "min_pages"  # the floor: the target leaves no room, the prompt still advances
    UNMEASURED = "unmeasured"  # no step timed yet: the cap
    GRAPHS = "graphs"  # what the step's decode rows leave of the piecewise graphs' tokens (beyond: an eager launch)


def prefill_budget(
    max_tokens: int,
    page_size: int,
    target_s: float,
    decoding: bool,
    model: StepTimeModel,
    context: StepContext,
    margin_z: float = 0.0,
    prefill_tokens_per_s: float = 0.0,
    decode_step_s: float = 0.0,
    max_step_s: float = 0.0,
) -> tuple[int, str]:
    """The next step's prompt tokens in whole pages (at least MIN_PAGES) and what sized them: beside decoding
    the largest chunk `model` predicts within `target_s` less `margin_z` spreads (before chunks are timed: the
    prefill speed over the target less the decode step), alone `max_tokens`. Every step stays within `max_step_s`
    (0: no bound): the engine reads commands only between steps."""
    beside = decoding and target_s > 0
    limit = target_s if beside else 0.0
    bound = BudgetReason.ITL_TARGET
    if max_step_s > 0 and (limit <= 0 or max_step_s < limit):
        limit, bound = max_step_s, BudgetReason.MAX_STEP
    if limit <= 0:
        return max_tokens, BudgetReason.MAX_PREFILL_TOKENS
    if not beside:
        context, margin_z, decode_step_s = StepContext(chunk_start=context.chunk_start), 0.0, 0.0
    # No step takes less than its decode step plus its prompt tokens at the fastest prefill measured alone: a
    # bound on the fit beside decoding, whose prompt-token cost can come out near zero while its window's chunks
    # are all alike. (Not for the max-step bound alone: the fastest prefill seen may be a short prompt's, whose
    # fixed cost makes it slower per token than the long chunk being sized.)
    by_speed = int(prefill_tokens_per_s * max(limit - decode_step_s, 0.0)) // page_size * page_size
    if model.ready:
        tokens = model.largest_chunk(
            limit, context.decode_rows, context.decode_context, context.chunk_start, max_tokens, page_size, margin_z
        )
        if beside and prefill_tokens_per_s > 0:
            tokens = min(tokens, by_speed)
    elif prefill_tokens_per_s > 0:
        tokens = by_speed
    else:
        return max_tokens, BudgetReason.UNMEASURED
    if tokens >= max_tokens:
        return max_tokens, BudgetReason.MAX_PREFILL_TOKENS
    if tokens < MIN_PAGES * page_size:
        return min(max_tokens, MIN_PAGES * page_size), BudgetReason.MIN_PAGES
    return tokens, bound


def within_graphs(tokens: int, reason: str, decode_rows: int, graphed_tokens: int, page_size: int) -> tuple[int, str]:
    """A budget beside `decode_rows` decoding rows held to what the piecewise step graphs leave them, so the step
    replays graphs instead of launching eagerly: an eager FP8 8B step's launch took 40 ms of host time at p50 (14
    graphed), longer than the decode step in flight before it, and every running stream waited it out (H100,
    bench/RESULTS.md "Where the shared token gaps ... went"). Not when the rows take more than half the graphs'
    tokens: the chunk would shrink by more than the launch costs."""
    room = (graphed_tokens - decode_rows) // page_size * page_size
    if graphed_tokens <= 0 or decode_rows <= 0 or tokens <= room or room < graphed_tokens // 2:
        return tokens, reason
    return room, BudgetReason.GRAPHS


def prefill_token_budget(*args: object, **kwargs: object) -> int:
    return prefill_budget(*args, **kwargs)[0]  # type: ignore[arg-type]


@dataclass
class PrefillSpeed:
    """Prompt tokens per second, an exponential moving average over the intervals observed."""

    smoothing: float = 0.2
    tokens_per_s: float = 0.0
    peak_tokens_per_s: float = 0.0  # the fastest interval (the budget's speed: one model on one device)

    def seed_peak(self, tokens_per_s: float) -> None:
        """A speed measured before serving (the warm-up's full-size prefill): the peak starts there."""
        self.peak_tokens_per_s = max(self.peak_tokens_per_s, tokens_per_s)

    def observe(self, tokens: int, seconds: float, allow_zero: bool = False) -> None:
        """One interval; `allow_zero`: an interval that computed nothing (a stalled queue) counts as a sample."""
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
    """A step's duration, an exponential moving average (0 until the first step)."""

    smoothing: float = 0.2
    seconds: float = 0.0

    def observe(self, seconds: float) -> None:
        if seconds <= 0:
            return
        self.seconds = seconds if self.seconds <= 0 else self.seconds + self.smoothing * (seconds - self.seconds)
