"""Adaptive placement: predicted TTFT and ITL cost of each way to serve one request, as pure functions.

A request can be placed two ways (router/decision/policy.py picks the decode pod D first, by its own load):

local on D
    D prefills the prompt itself, in chunks that join its running decode batch.
disaggregated via P
    a prefill pod P computes the prompt, its KV moves to D, D decodes.

Predicted time to first token (seconds): the one prediction admission also uses (router/decision/ttft_model.py: the
pod's step-time model over its queue ahead of this request's class, plus the transfer for P), set on each side
as ``predicted_ttft_s`` by the dispatcher. A pod that has no step model yet falls back to its own measured
prefill rate ``rate_x`` (``prefill_tokens_per_s`` in its /load, common/serving/prefill_rate.py):

    ttft_local   = (queued_D + uncached_D) / rate_D
    ttft_disagg  = (queued_P + uncached_P) / rate_P + prompt_len / transfer_tokens_per_s

``queued_x`` is the prefill work ahead of this request (the pod's queue or the router's own count of
tokens sent to it, whichever is larger), ``uncached_x`` the prompt tokens that pod does not hold. The
transfer moves the whole prompt's KV; no pod publishes a transfer rate yet, so it is a setting
(``transfer_tokens_per_s``, default 200k tokens/s: an 8B model's ~128 KiB of KV per token at ~25 GB/s).

ITL that a prefill inflicts on the decode batch it joins (the gap between two of that batch's tokens while
its chunks run: with stall-free batching every step carries one token of each running request plus at most
one step's chunk budget, common/sched/prefill_budget.py), zero when the pod runs no batch:

    itl_local  = step_D + min(chunk_D, uncached_D) / speed_D
    itl_disagg = 0                                          (P is a prefill pod: D only receives KV pages)
    itl_disagg = step_P + min(chunk_P, uncached_P) / speed_P   (P is a mixed pod decoding a batch of its own)

``chunk_x`` is what one step of the pod takes beside the requests it decodes (the budget its ITL target
allows, ``KVFERRY_ITL_TARGET_MS``; 0 from a prefill-first pod, whose prompt runs whole before its batch
decodes again: the chunk is then the whole uncached prompt), ``speed_x`` its device-timed prefill
speed (``prefill_step_tokens_per_s``: the time a chunk really adds to a step; the drain rate where a pod
has not reported one), ``step_x`` its recent decode step (``decode_step_s``).

Choice: every placement is scored ``(misses ITL SLO, misses TTFT SLO, ttft)`` against the request's own SLO
class's targets (common/slo.py; a class without a TTFT target never misses it) and the lowest wins. So a
placement meeting both SLOs wins over any that misses one, the lowest predicted TTFT among those; when
none meets both, an ITL miss weighs more than a TTFT miss (an ITL miss slows every request in D's batch,
a TTFT miss only this one), and among equal misses the lowest predicted TTFT wins. Ties go to the local
placement (no transfer, no second pod).

Missing measurements: a pod with neither a prediction nor a rate has not measured yet. D without a rate of its own takes the
median of the prefill pods' (``with_fleet_prior``: one model on one kind of device; a decode pod that
always disaggregates never prefills, so it would never measure). When no pod has a rate, or no prefill
pod has one while some are up, ``choose_placement`` returns None: the caller falls back to the fixed
thresholds (``disagg_min_prompt_tokens``, ``local_prefix_fraction``). Prefill pods without a rate are left
out of the comparison while another one has a rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

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
    """One request's targets: its SLO class's (common/slo.py). ttft_s None: no TTFT target."""

    ttft_s: float | None
    itl_s: float


@dataclass(frozen=True)
class LocalSide:
    """The decode pod D, as the model sees it."""

    key: str
    queued_tokens: int  # prefill work ahead of this request on D
    uncached_tokens: int  # prompt tokens D would compute
    rate: float  # D's measured prefill tokens/s (0: unknown)
    chunk_tokens: int  # D's prefill tokens per step (0: unknown, then one chunk = the whole prompt)
    busy: bool  # D runs a decode batch that a local prefill would slow
    step_speed: float = 0.0  # D's device-timed prefill tokens/s: a chunk's time in a step (0: unknown -> rate)
    decode_step_s: float = 0.0  # D's recent decode step (0: unknown)
    predicted_ttft_s: float | None = None  # router/decision/ttft_model.py's prediction (None: the rate formula)


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Placement:
    prefill: str | None  # None: local on D
    ttft_s: float
    itl_cost_s: float
    meets_ttft: bool
    meets_itl: bool

    @property
    def reason(self) -> str:
        """The routing-decision label: which placement won and whether it meets the SLOs."""
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
    """The gap between two tokens of the decode batch a prefill joins, while its chunks run: the pod's decode
    step plus one chunk's compute (0 when the pod decodes nothing)."""
    if not side.busy or side.uncached_tokens <= 0:
        return 0.0
    chunk = min(side.chunk_tokens, side.uncached_tokens) if side.chunk_tokens > 0 else side.uncached_tokens
    speed = side.step_speed if side.step_speed > 0 else side.rate
    return side.decode_step_s + (chunk / speed if speed > 0 else 0.0)


def local_itl_cost_s(d: LocalSide) -> float:
    return itl_cost_s(d)


def with_fleet_prior(d: LocalSide, prefill: Sequence[PrefillSide]) -> LocalSide:
    """D's rates, or where D has measured none the median of the prefill pods' (same model, same kind of
    device): a decode pod that the fixed rules always disaggregate never prefills, so it would never measure."""
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
    """Every placement the model can predict (local first); empty when D has measured nothing."""
    d = with_fleet_prior(d, prefill)
    if not _known(d):
        return []
    out = [_placement(None, local_ttft_s(d), local_itl_cost_s(d), slo)]
    out += [
        # Zero on a prefill pod (busy False); a mixed pod's own batch bears the same cost as a local prefill.
        _placement(p.key, disagg_ttft_s(p, prompt_len, transfer_tokens_per_s), itl_cost_s(p), slo)
        for p in prefill
        if _known(p)
    ]
    return out


def choose_placement(
    d: LocalSide, prefill: Sequence[PrefillSide], prompt_len: int, slo: SloTargets, transfer_tokens_per_s: float
) -> Placement | None:
    """The best placement by the order in the module docstring; None when the fixed rules must decide
    (D unmeasured, or no prefill pod measured while some are up)."""
    options = placements(d, prefill, prompt_len, slo, transfer_tokens_per_s)
    if not options or (prefill and len(options) == 1):
        return None
    # min() keeps the first of equal keys: local, then prefill pods in the caller's order.
    return min(options, key=lambda o: (not o.meets_itl, not o.meets_ttft, o.ttft_s))
