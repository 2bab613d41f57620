"""How many prompt tokens a step may take beside the requests it decodes (stall-free batching).

Every step carries one token for every running request; prompt chunks ride along up to a token budget, the
largest of three sizes:
- **the ITL chunk**: the step that carries a chunk is the gap between two of every running request's tokens,
  and it costs the decode step D it replaces plus what its chunk adds, so the chunk is what the engine
  prefills in T - D (T: the ITL target) at the chunk speed beside decoding: the chunk tokens over the mixed
  steps' device time less the decode step's, smoothed (`chunk_speed`). That feedback settles where a chunk's
  step takes T: on the H200 (8B) a chunk beside decoding adds 50-90k tok/s at 128-256 tokens, above the
  ~40k tok/s of a large prefill-only chunk, since the decode rows already read the weights (bench/RESULTS.md
  "Stall-free batching"). On the GPU prefill and mixed steps run as piecewise CUDA graphs
  (common/engine/gpu/step_graphs.py), so a small chunk costs its compute, not the launch of every kernel.
- **the keep-up chunk**: prefill must keep up with the prompt tokens arriving (`ArrivalRate`, over the last
  ARRIVALS_SEEN admissions, so one long prompt alone is not a rate) with KEEP_UP_MARGIN to spare: a chunk c
  prefills at c / (D + c / speed), so c = m*rate*D / (1 - m*rate/speed), its step at most KEEP_UP_MAX_STEPS
  decode steps (near saturation that formula's pole turns a noisy rate into full chunks; a queue that still
  grows is the backlog's). Sustained load (~75% of saturation) makes steps a little longer than the target
  instead of letting the queue and TTFT grow without bound.
- **the backlog chunk**: the prompt tokens queued behind the prompt being prefilled (one long prompt alone has
  none) are worked off within BACKLOG_STEPS steps: a burst grows the chunk in proportion to it, its step at most
  BACKLOG_MAX_STEPS decode steps while the queue is shorter than BACKLOG_FLOOD_CHUNKS such chunks (a Poisson burst
  at ~80% load: the ITL p99 is those steps); a longer queue (a saturated worker) runs full chunks with its
  decode rows riding along.

The target is by default a multiple (2) of the engine's own decode step (device-timed, smoothed), so it
follows the model, the hardware and the batch size without tuning; `KVFERRY_ITL_TARGET_MS` sets another
multiple (`2.5x`) or milliseconds; 0 turns mixed steps off (prefill-first: a waiting prompt's chunks run back
to back, each taking `max_prefill_tokens`, and decoding waits for them; kept for A/B runs). Steps without
decoding requests take the whole `max_prefill_tokens`.

No starvation: the budget never falls below MIN_PAGES pages, so a waiting prompt progresses every step even
when the target leaves no room (a decode step that alone exceeds it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_PAGES = 4  # the budget never falls below this many pages: tiny chunks would starve prompts altogether
# A backlog queued behind the prompt being prefilled is worked off in about this many steps: a burst of a few
# prompts grows the chunk a little, a saturated queue to all of max_prefill_tokens. (A rule that jumped to half
# the backlog as soon as it exceeded two ITL chunks fired whenever two prompts overlapped, at ~45% load on the
# H200 already, and those steps were the ITL p99: bench/RESULTS.md "Stall-free batching".)
BACKLOG_STEPS = 32
# Prefill keeps up with arrivals with this margin: the keep-up chunk's prefill rate is this multiple of the
# arrival rate (a queue's utilisation 1/KEEP_UP_MARGIN at most).
KEEP_UP_MARGIN = 1.3
# The backlog chunk's step is at most this many decode steps (below the 4x bound at ~80% load) while the
# queue holds fewer than BACKLOG_FLOOD_CHUNKS chunks that size; past that the queue's wait, not the ITL, is what
# users see, and the chunk is the backlog's share uncapped (saturation throughput).
BACKLOG_MAX_STEPS = 3.5
BACKLOG_FLOOD_CHUNKS = 128
ARRIVALS_SEEN = 32  # the arrival rate is measured over this many admissions (fewer: no rate yet)
# The keep-up chunk's step is at most this many decode steps: served on the H200 at ~75% load, a cap of 3.5 put
# the ITL p90 at the cap (26 ms) and the p99 at 4.9x the decode step, past the 4x bound of ~80% load.
KEEP_UP_MAX_STEPS = 3.0
# The chunk speed beside decoding stays within these multiples of the peak prefill-only speed: a mixed step timed
# at about the decode step (noise, a batch that changed) would otherwise claim an unbounded speed.
CHUNK_SPEED_RANGE = (0.25, 2.5)


def prefill_token_budget(
    max_tokens: int,
    page_size: int,
    tokens_per_s: float,
    itl_target_s: float,
    decoding: bool,
    backlog_tokens: int = 0,
    decode_step_s: float = 0.0,
    arrival_tokens_per_s: float = 0.0,
) -> int:
    """`max_tokens`, or while requests decode (and the target and speed are known) the largest of the ITL
    chunk (what is prefilled in `itl_target_s - decode_step_s`), the keep-up chunk for `arrival_tokens_per_s`
    and a 1/BACKLOG_STEPS share of the `backlog_tokens` queued (capped below a flood); whole pages, at least MIN_PAGES pages."""
    if not decoding or itl_target_s <= 0 or tokens_per_s <= 0:
        return max_tokens
    itl = tokens_per_s * max(itl_target_s - decode_step_s, 0.0)
    need = KEEP_UP_MARGIN * arrival_tokens_per_s
    cap = step_chunk(tokens_per_s, decode_step_s, KEEP_UP_MAX_STEPS)
    keep_up = cap if need >= tokens_per_s else min(cap, need * decode_step_s / (1.0 - need / tokens_per_s))
    backlog = backlog_tokens / BACKLOG_STEPS
    backlog_cap = step_chunk(tokens_per_s, decode_step_s, BACKLOG_MAX_STEPS)
    if backlog_tokens < BACKLOG_FLOOD_CHUNKS * backlog_cap:
        backlog = min(backlog, backlog_cap)
    tokens = int(max(itl, keep_up, backlog))
    return min(max_tokens, max(MIN_PAGES * page_size, tokens // page_size * page_size))


def step_chunk(tokens_per_s: float, decode_step_s: float, decode_steps: float) -> float:
    """The chunk whose mixed step takes `decode_steps` decode steps: the decode step plus what the chunk adds."""
    return tokens_per_s * (decode_steps - 1.0) * decode_step_s


def marginal_seconds(step_s: float, decode_step_s: float) -> float:
    """What a mixed step's chunk added to the decode step, at least a tenth of the step (a step timed at about
    the decode step says its chunk was cheap, not free)."""
    return max(step_s - decode_step_s, 0.1 * step_s)


def chunk_speed(peak_prefill_tokens_per_s: float, mixed_tokens_per_s: float) -> float:
    """The budget's chunk tokens/s beside decoding: the mixed steps' (smoothed, marginal) within
    CHUNK_SPEED_RANGE of the peak prefill-only speed, or that peak until a mixed step was timed."""
    if mixed_tokens_per_s <= 0 or peak_prefill_tokens_per_s <= 0:
        return max(peak_prefill_tokens_per_s, mixed_tokens_per_s)
    lo, hi = CHUNK_SPEED_RANGE
    return min(max(mixed_tokens_per_s, lo * peak_prefill_tokens_per_s), hi * peak_prefill_tokens_per_s)


@dataclass
class ArrivalRate:
    """Prompt tokens per second arriving, over the last ARRIVALS_SEEN admissions: the tokens of all but the
    oldest over the time since the oldest, so it falls while none arrive; 0 until that many were seen."""

    seen: int = ARRIVALS_SEEN
    _times: deque[float] = field(default_factory=deque)
    _tokens: deque[int] = field(default_factory=deque)

    def add(self, now: float, tokens: int) -> None:
        self._times.append(now)
        self._tokens.append(tokens)
        if len(self._times) > self.seen:
            self._times.popleft()
            self._tokens.popleft()

    def tokens_per_s(self, now: float) -> float:
        if len(self._times) < self.seen:
            return 0.0
        span = now - self._times[0]
        return (sum(self._tokens) - self._tokens[0]) / span if span > 0 else 0.0


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
