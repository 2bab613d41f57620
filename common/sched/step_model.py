"""How long a step takes, from what it computes: the engine's own capacity model (common/capacity.py), a
least-squares fit with no negative cost over the last WINDOW timed steps (and the last PROMPT_KEEP steps that
carried prompt tokens, however old), refitted every REFIT_EVERY steps
(microseconds on the host; it follows a change of batch mix within a few hundred steps). The budget keeps a
margin of residual spreads, so a percentile target is held by the steps, not only by the mean.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from common.capacity import chunk_attention, largest_fitting

__all__ = ["StepShape", "StepTimeModel", "chunk_attention", "z_score"]

WINDOW = 256  # timed steps the fit reads: a few seconds of steps on a GPU, enough to span batch sizes
# Steps with prompt tokens the fit keeps after they leave the window: a drain or a quiet spell of decode-only
# steps longer than the window would otherwise leave the per-token cost unidentified (the ridge takes it to ~0)
# and the first chunks after it sized as if prompts were free (an H100 trace: a 2,048-token step predicted 5.8 ms,
# took 43 ms; chunk steps ran up to 12 ms past their prediction for the next 30 steps).
PROMPT_KEEP = 64
REFIT_EVERY = 16  # steps between refits (each a 5x5 solve, its cost spread over the steps)
MIN_PREFILL_SAMPLES = 4  # timed steps with prompt tokens before the model sizes chunks (until then: no budget)
# Feature scales: the fit solves in units near 1 whatever the model size, so the ridge term weighs them alike.
_SCALES = np.array([1.0, 1e3, 1e2, 1e5, 1e6])
_RIDGE = 1e-6


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int = 0
    decode_rows: int = 0
    decode_context: int = 0  # KV tokens the decode rows attend over
    chunk_attention: float = 0.0  # sum over prompt chunks of n * (start + n / 2)

    def features(self) -> np.ndarray:
        raw = (1.0, self.prefill_tokens, self.decode_rows, self.decode_context, self.chunk_attention)
        return np.asarray(raw, dtype=np.float64) / _SCALES


def z_score(percentile: float) -> float:
    """The normal quantile of a percentile (99 -> 2.33): the margin, in residual spreads, holding it."""
    return NormalDist().inv_cdf(min(max(percentile, 50.0), 99.99) / 100)


@dataclass
class StepTimeModel:
    window: int = WINDOW
    refit_every: int = REFIT_EVERY
    prompt_keep: int = PROMPT_KEEP
    _x: deque[np.ndarray] = field(default_factory=deque)
    _y: deque[float] = field(default_factory=deque)
    # prompt steps that left the window, newest last: (features, seconds); with the window's own prompt steps
    # at most `prompt_keep` in all
    _kept_x: deque[np.ndarray] = field(default_factory=deque)
    _kept_y: deque[float] = field(default_factory=deque)
    _window_prompts: int = 0
    _coef: np.ndarray | None = None
    _spread: float = 0.0
    _since_fit: int = 0
    _prefill_samples: int = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds):
            return
        self._x.append(shape.features())
        self._y.append(seconds)
        if shape.prefill_tokens:
            self._prefill_samples += 1
            self._window_prompts += 1
        if len(self._x) > self.window:
            x, y = self._x.popleft(), self._y.popleft()
            if x[1] > 0:  # it carried prompt tokens (features: base, prompt tokens, ...)
                self._window_prompts -= 1
                self._kept_x.append(x)
                self._kept_y.append(y)
        while self._kept_x and len(self._kept_x) + self._window_prompts > self.prompt_keep:
            self._kept_x.popleft()
            self._kept_y.popleft()
        self._since_fit += 1
        if self._coef is None or self._since_fit >= self.refit_every or len(self._x) < self.refit_every:
            self._fit()

    @property
    def ready(self) -> bool:
        """Whether the fit has timed prompt chunks (until then a chunk's cost is unknown)."""
        return self._coef is not None and self._prefill_samples >= MIN_PREFILL_SAMPLES and self._coef[1] > 0

    @property
    def spread_s(self) -> float:
        return self._spread

    def predict(self, shape: StepShape) -> float:
        if self._coef is None:
            return 0.0
        return float(shape.features() @ self._coef)

    def coefficients(self) -> dict[str, float]:
        names = ("base_s", "per_prefill_token_s", "per_decode_row_s", "per_context_token_s", "per_attention_pair_s")
        coef = self._coef if self._coef is not None else np.zeros(5)
        return {n: float(c / s) for n, c, s in zip(names, coef, _SCALES)}

    def largest_chunk(
        self,
        target_s: float,
        decode_rows: int,
        decode_context: int,
        chunk_start: int,
        max_tokens: int,
        granularity: int,
        margin_z: float = 0.0,
    ) -> int:
        """The most prompt tokens (a multiple of `granularity`, at most `max_tokens`) a step beside `decode_rows`
        may take, predicted plus `margin_z` spreads within `target_s`; 0 when not even `granularity` fits."""
        if not self.ready:
            return 0
        allowed = target_s - margin_z * self._spread

        def fits(units: int) -> bool:
            n = units * granularity
            shape = StepShape(n, decode_rows, decode_context, chunk_attention(chunk_start, n))
            return self.predict(shape) <= allowed

        return largest_fitting(fits, max_tokens // granularity) * granularity

    def _fit(self) -> None:
        self._since_fit = 0
        x = np.stack([*self._kept_x, *self._x])
        y = np.asarray([*self._kept_y, *self._y])
        active = np.ones(x.shape[1], dtype=bool)
        coef = np.zeros(x.shape[1])
        # No negative cost: a feature fitted negative (collinear, or not varied yet) is dropped and the rest refitted.
        for _ in range(x.shape[1]):
            xa = x[:, active]
            gram = xa.T @ xa + _RIDGE * len(y) * np.eye(xa.shape[1])
            sol = np.linalg.solve(gram, xa.T @ y)
            coef = np.zeros(x.shape[1])
            coef[active] = sol
            negative = active & (coef < 0)
            negative[0] = False  # the base may be anything; the other costs are not negative
            if not negative.any():
                break
            active &= ~negative
        coef[1:] = np.maximum(coef[1:], 0.0)
        self._coef = coef
        resid = y - x @ coef
        self._spread = float(np.sqrt(np.mean(resid**2))) if len(y) > x.shape[1] else 0.0
