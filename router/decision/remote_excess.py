"""What a remote prefill's first token costs beyond its prediction, measured against a local one's, and added to
every remote prediction where placement is adaptive.

Why: the prediction of a remote prefill (router/decision/ttft_model.py) is the prefill pod's queue and compute plus
the KV's bytes at `transfer_tokens_per_s`. The path has costs that neither side publishes: the decode pod's call to
the peer, the peer's admission, the transfer's tail after the last chunk and the decode pod's step that takes the
landed request in. Two mixed pods on one H100 (bench/RESULTS.md, "Placement prices a chunk by the pod's step
model") took 40-85 ms longer from the decode pod's request to the KV's landing than the peer's queue and prefill at
6-12 req/s, where the prediction added 5-15 ms for the bytes. Adaptive placement ranks the paths by predicted TTFT,
so it sent 40-56% of prompts to the peer, ~70 ms later each, where the local prefill met the same targets.

The path's excess is the median of (measured - predicted) TTFT over recent remote placements less the same over
local ones: whatever the two paths share (tokenization, the router's relay, a step model off in the same way on
both) cancels, and what is left is the remote path's own. Medians over the last `WINDOW` placements of each, as a
stall or a burst moves a median little. The raw prediction is what each sample compares against (the excess added
at placement taken off again by the caller), so the correction does not chase itself. Until both paths have `MIN_SAMPLES`, and
under fixed placement (whose local prompts are the short ones, so a remote one differs from them by its length as
well as its path), the excess is 0: the predictions as they are.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

__all__ = ["MAX_EXCESS_S", "MIN_SAMPLES", "WINDOW", "RemoteExcess"]

# The recent placements of each path the medians are read from: at a few requests a second, the last ~20 s.
WINDOW = 64
# The fewest placements of each path before the excess is read; before that, 0.
MIN_SAMPLES = 8
# An excess beyond this says a path is broken (a peer down, retries), not slower: it is capped, as admission's
# error factor is (router/decision/ttft_error.py), and the fixed rules' fallbacks handle the failures.
MAX_EXCESS_S = 1.0


@dataclass(slots=True)
class RemoteExcess:
    """Measured less predicted TTFT per path; `excess_s` is what a remote prediction adds."""

    _local: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _remote: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _excess_s: float = 0.0

    @property
    def excess_s(self) -> float:
        return self._excess_s

    def observe(self, remote: bool, measured_s: float, raw_predicted_s: float) -> None:
        """One placement's first token, against its prediction without the excess."""
        (self._remote if remote else self._local).append(measured_s - raw_predicted_s)
        if len(self._local) < MIN_SAMPLES or len(self._remote) < MIN_SAMPLES:
            return
        self._excess_s = min(MAX_EXCESS_S, max(0.0, median(self._remote) - median(self._local)))
