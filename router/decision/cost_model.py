"""Adaptive placement: predicted TTFT and ITL cost of serving one request locally on its decode pod or through
a prefill pod, as pure functions (docs/architecture.md, "Placement"). Scored ``(misses ITL, misses TTFT, ttft)``,
lowest wins, ties local: an ITL miss slows D's whole batch, a TTFT miss only this request. No rate to compare:
None, and the fixed thresholds decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from common.capacity import StepCost, chunk_attention

__all__ = [
    "LocalSide",
    "Placement",
    "PrefillSide",
    "SloTargets",
    "choose_placement",
    "disagg_ttft_s",
    "itl_cost_s",
    "local_itl_cost_s",
    "local_ttft_s",
    "with_fleet_prior",
]


@dataclass(frozen=True)
class SloTargets:
    """One request's targets, its SLO class's; ttft_s None: no TTFT target."""

    ttft_s: float | None
    itl_s: float


# slots, not frozen: built per candidate per request, where a frozen dataclass's __init__ costs ~3x
@dataclass(slots=True)
class LocalSide:
    key: str
    queued_tokens: int  # prefill work ahead of this request on D
    uncached_tokens: int  # prompt tokens D would compute
    rate: float  # D's measured prefill tokens/s (0: unknown)
    chunk_tokens: int  # D's prefill tokens per step (0: unknown, then one chunk = the whole prompt)
    busy: bool  # D runs a decode batch that a local prefill would slow
    step_speed: float = 0.0  # D's device-timed prefill tokens/s: a chunk's time in a step (0: unknown -> rate)
    decode_step_s: float = 0.0  # D's recent decode step (0: unknown)
    predicted_ttft_s: float | None = None  # router/decision/ttft_model.py's prediction (None: the rate formula)
    step_cost: StepCost | None = None  # D's fitted step-time model (None or unknown: the speed formula)
    decode_rows: int = 0  # the batch D decodes now, and its context in tokens: what a chunk steps beside
    decode_context: int = 0


@dataclass(slots=True)
class PrefillSide:
    key: str
    queued_tokens: int
    uncached_tokens: int
    rate: float
    chunk_tokens: int = 0  # its prefill tokens per step (0: unknown)
    busy: bool = False  # a mixed pod running its own decode batch, which this prefill would slow
    step_speed: float = 0.0
    decode_step_s: float = 0.0
    predicted_ttft_s: float | None = None  # the prediction, transfer included (None: the rate formula)
    step_cost: StepCost | None = None
    decode_rows: int = 0
    decode_context: int = 0


@dataclass(slots=True)
class Placement:
    prefill: str | None  # None: local on D
    ttft_s: float
    itl_cost_s: float
    meets_ttft: bool
    meets_itl: bool

    @property
    def reason(self) -> str:
        kind = "local" if self.prefill is None else "disaggregated"
        if self.meets_ttft and self.meets_itl:
            return f"adaptive-{kind}"
        return f"adaptive-{kind}-slo-miss"


def _known(side: LocalSide | PrefillSide) -> bool:
    return side.predicted_ttft_s is not None or side.rate > 0


def local_ttft_s(d: LocalSide) -> float:
    if d.predicted_ttft_s is not None:
        return d.predicted_ttft_s
    return (d.queued_tokens + d.uncached_tokens) / d.rate


def itl_cost_s(side: LocalSide | PrefillSide) -> float:
    """The gap a prefill opens in the decode batch it joins: one step of its batch with one chunk (0: nothing
    decoding). Where the pod publishes its step model, the step that model predicts, as the pod's own budget sized
    the chunk by it. The recent decode step plus the chunk at the mean prefill speed counts the step's fixed part
    twice, the speed being a whole chunk step's tokens a second: two mixed pods on one H100 read 51 ms for the
    1,056-token chunks their budget had sized to 40.7 ms, took every local prefill for an ITL miss, and sent half
    of them to the other pod (bench/RESULTS.md, "Placement prices a chunk by the pod's step model")."""
    if not side.busy or side.uncached_tokens <= 0:
        return 0.0
    chunk = min(side.chunk_tokens, side.uncached_tokens) if side.chunk_tokens > 0 else side.uncached_tokens
    cost = side.step_cost
    if cost is not None and cost.known:
        return cost.step_s(chunk, max(side.decode_rows, 1), side.decode_context, chunk_attention(0, chunk))
    speed = side.step_speed if side.step_speed > 0 else side.rate
    return side.decode_step_s + (chunk / speed if speed > 0 else 0.0)


def local_itl_cost_s(d: LocalSide) -> float:
    return itl_cost_s(d)


def with_fleet_prior(d: LocalSide, prefill: Sequence[PrefillSide]) -> LocalSide:
    """D's rates, or the prefill pods' median where D measured none (it may always disaggregate, never measuring)."""
    if d.rate > 0:
        return d
    rates = sorted(p.rate for p in prefill if p.rate > 0)
    if not rates:
        return d
    speeds = sorted(p.step_speed for p in prefill if p.step_speed > 0)
    return replace(
        d,
        rate=rates[len(rates) // 2],
        step_speed=d.step_speed or (speeds[len(speeds) // 2] if speeds else 0.0),
    )


def disagg_ttft_s(p: PrefillSide, prompt_len: int, transfer_tokens_per_s: float) -> float:
    if p.predicted_ttft_s is not None:
        return p.predicted_ttft_s
    transfer = prompt_len / transfer_tokens_per_s if transfer_tokens_per_s > 0 else 0.0
    return (p.queued_tokens + p.uncached_tokens) / p.rate + transfer


def _placement(prefill: str | None, ttft: float, itl: float, slo: SloTargets) -> Placement:
    return Placement(prefill, ttft, itl, slo.ttft_s is None or ttft <= slo.ttft_s, itl <= slo.itl_s)


def placements(
    d: LocalSide, prefill: Sequence[PrefillSide], prompt_len: int, slo: SloTargets, transfer_tokens_per_s: float
) -> list[Placement]:
    d = with_fleet_prior(d, prefill)
    if not _known(d):
        return []
    out = [_placement(None, local_ttft_s(d), local_itl_cost_s(d), slo)]
    out += [
        # Zero on a prefill pod; a mixed pod's own batch bears the same cost as a local prefill.
        _placement(p.key, disagg_ttft_s(p, prompt_len, transfer_tokens_per_s), itl_cost_s(p), slo)
        for p in prefill
        if _known(p)
    ]
    return out


def choose_placement(
    d: LocalSide, prefill: Sequence[PrefillSide], prompt_len: int, slo: SloTargets, transfer_tokens_per_s: float
) -> Placement | None:
    """The best placement (module docstring's order); None: the fixed rules decide."""
    options = placements(d, prefill, prompt_len, slo, transfer_tokens_per_s)
    if not options or (prefill and len(options) == 1):
        return None
    # min() keeps the first of equal keys: local, then prefill pods in the caller's order.
    return min(options, key=lambda o: (not o.meets_itl, not o.meets_ttft, o.ttft_s))
