"""How many prompt tokens a step may take beside the requests it decodes (stall-free batching).

Every step carries one token for every running request; prompt chunks ride along up to a token budget: the
largest chunk whose step the engine's step-time model (common/sched/step_model.py, fitted to its own timed
steps) predicts within the ITL target, with a margin of the model's residual spread times the normal quantile
of the percentile the target holds at. The step that carries a chunk is the gap between two of every running
request's tokens, so the running requests' ITL stays within the target while prompts prefill as fast as it
allows; one rule, no hand-set multiples of the decode step.

The target (common/sched/scheduler.py `itl_target_s`) is by default the SLO's (common/slo.py): the tightest
ITL target among the classes of the requests being decoded, but never under FLOOR_DECODE_STEPS decode steps:
where decoding alone takes more than half the target (a CPU, a huge batch) the target cannot be met by any
chunk, and a prompt still gets half the engine. `KVFERRY_ITL_TARGET_MS` sets milliseconds, `<k>x` decode steps,
or 0: prefill-first (a waiting prompt's chunks run back to back, each taking `max_prefill_tokens`, and decoding
waits for them; kept for A/B runs). Steps without decoding requests take the whole `max_prefill_tokens`.

Until the model has timed prompt chunks, the chunk is what the measured prefill speed computes in the target
less the decode step (the same bound, from two numbers instead of a fit).

Every step, with or without decoding, is also kept within `KVFERRY_MAX_STEP_MS` (`prefill_budget` says why);
on a GPU no chunk comes near it.

No starvation: the budget never falls below MIN_PAGES pages, so a waiting prompt progresses every step even
when the target leaves no room (a decode step that alone exceeds it).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.sched.step_model import StepTimeModel

MIN_PAGES = 4  # the budget never falls below this many pages: tiny chunks would starve prompts altogether
# The SLO target never falls under this many decode steps: below, decoding alone would take more than half of
# each step and prompts would prefill in MIN_PAGES slivers (a 5k-token prompt: ~80 steps), TTFT without bound.
FLOOR_DECODE_STEPS = 2.0


@dataclass(frozen=True)
class StepContext:
    """What the next step decodes beside its chunk: the model's inputs other than the chunk itself."""

    decode_rows: int = 0
    decode_context: int = 0
    chunk_start: int = 0  # where the next chunk starts in its prompt (its attention reads that prefix)


class BudgetReason:
    """What sized a step's prompt-token budget (named in the step plan, common/sched/step_plan.py)."""

    ITL_TARGET = "itl_target"  # the largest chunk predicted within the ITL target beside the decode rows
    MAX_STEP = "max_step"  # the largest chunk predicted within KVFERRY_MAX_STEP_MS
    MAX_PREFILL_TOKENS = "max_prefill_tokens"  # the cap itself (no target applies, or the target allows more)
    MIN_PAGES = "min_pages"  # the floor: the target leaves no room, the prompt still advances
    UNMEASURED = "unmeasured"  # no step timed yet: the cap


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
    """The prompt tokens of the next step, in whole pages, at least MIN_PAGES pages, and what sized them
    (a `BudgetReason`): beside decoding the largest chunk whose step `model` predicts within `target_s` (less
    `margin_z` residual spreads); alone (or with no target) `max_tokens`. Either way a step is predicted within
    `max_step_s` (0: no bound): the engine reads its commands between steps, so a step of tens of seconds (a
    long chunk on a loaded CPU: bench/RESULTS.md, "Figures behind choices in the code") would leave control calls
    and cancellations unanswered that long. Before
    the model has timed chunks: the measured prefill speed over the limit less the decode step; before any
    speed is known, `max_tokens`."""
    beside = decoding and target_s > 0
    limit = target_s if beside else 0.0
    bound = BudgetReason.ITL_TARGET
    if max_step_s > 0 and (limit <= 0 or max_step_s < limit):
        limit, bound = max_step_s, BudgetReason.MAX_STEP
    if limit <= 0:
        return max_tokens, BudgetReason.MAX_PREFILL_TOKENS
    if not beside:
        context, margin_z, decode_step_s = StepContext(chunk_start=context.chunk_start), 0.0, 0.0
    if model.ready:
        tokens = model.largest_chunk(
            limit, context.decode_rows, context.decode_context, context.chunk_start, max_tokens, page_size, margin_z
        )
    elif prefill_tokens_per_s > 0:
        tokens = int(prefill_tokens_per_s * max(limit - decode_step_s, 0.0)) // page_size * page_size
    else:
        return max_tokens, BudgetReason.UNMEASURED
    if tokens >= max_tokens:
        return max_tokens, BudgetReason.MAX_PREFILL_TOKENS
    if tokens < MIN_PAGES * page_size:
        return min(max_tokens, MIN_PAGES * page_size), BudgetReason.MIN_PAGES
    return tokens, bound


def prefill_token_budget(*args: object, **kwargs: object) -> int:
    """`prefill_budget`'s tokens alone."""
    return prefill_budget(*args, **kwargs)[0]  # type: ignore[arg-type]


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
