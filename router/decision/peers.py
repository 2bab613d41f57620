"""Other router processes' placements on one worker, read from the worker's own count of accepted prompts.

A router process predicts a prompt's TTFT from the worker's last load snapshot plus the prompts it placed there
itself since (pool.py's `unseen_prompt_tokens`). What other processes placed in that time stays invisible until
the next poll, and there are many others: the router pod runs two processes and a fleet runs several pods. On an
H100 (bf16 8B, 24-36 req/s) measured TTFT reached 1.5-1.8x the prediction at p99 with two processes against
1.1x with one, and the error factor (ttft_error.py) sat at its 2.0 ceiling: half the queue's headroom refused
(bench/RESULTS.md, "FP8 against bf16 with the router fixed ..."; the simulator reproduces it: "Several router
processes in the simulator").

The worker counts every prompt token it accepted to prefill (`prompt_tokens_accepted` on /load). Between two
polls, what it accepted beyond this process's own placements came from the others; their rate over the last
polls, times the snapshot's age, is what they have likely placed since. It is scaled by the uncached share of
this process's own placements, as the others' prefix hits are not known here.

The decode pick reads the others' decode calls the same way, from the worker's count of requests it accepted to
decode (`decodes_accepted`): a request is the unit, and none is cached.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["WINDOW_POLLS", "PeerPlacements"]

# Polls the rate is taken over: 2 s at the default 0.25 s poll, several placements even at a few requests/s,
# and short enough to follow a burst within a second or two. Counted over the whole window, not per poll: a
# prompt placed just before a poll may reach the worker's count only after it, and per-poll differences clamped
# at zero would count that as the others' work.
WINDOW_POLLS = 8
# A placement reaches the worker's count a moment after this process counts it (a prefill pod's only once the
# decode pod reserved its pages, at its next step), so the window's ends can straddle one or two of this process's
# own: others below this many of its mean placements are that, not another process (a lone process on a simulated
# P+D fleet saw such a rate at 2% of its polls).
NOISE_PLACEMENTS = 3


@dataclass(slots=True)
class PeerPlacements:
    """The other processes' recent rate of uncached prompt tokens (or of decode calls) onto one worker (0: none
    seen, or a worker that does not count)."""

    rate: float = 0.0  # units per second
    # (poll asked at, worker's accepted count, this process's placed units, ... of them uncached, its placements)
    _polls: deque[tuple[float, int, int, int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW_POLLS + 1))

    def observe(self, asked: float, accepted: int, placed: int, placed_uncached: int, placements: int) -> None:
        """One poll: the worker's count and this process's running totals of what it placed there (units, the
        uncached ones, and how many placements)."""
        polls = self._polls
        if polls and accepted < polls[-1][1]:
            polls.clear()  # a restarted worker counts from zero again
        polls.append((asked, accepted, placed, placed_uncached, placements))
        first = polls[0]
        span = asked - first[0]
        if span <= 0:
            self.rate = 0.0
            return
        mine = placed - first[2]
        others = accepted - first[1] - mine
        count = placements - first[4]
        mean = mine / count if count > 0 else (placed / placements if placements > 0 else 0.0)
        if others <= NOISE_PLACEMENTS * mean:
            self.rate = 0.0
            return
        uncached_share = (placed_uncached - first[3]) / mine if mine > 0 else 1.0
        self.rate = others * uncached_share / span

    def placed_since(self, age_s: float) -> int:
        """Uncached units the others likely placed in the last `age_s` seconds."""
        return round(self.rate * age_s) if age_s > 0 else 0
