"""Admission: which workers can take one more request now, so overload is answered 429 + Retry-After before
latency collapses (the rules: docs/architecture.md, "SLOs", Admission)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common import settings_registry as reg
from common.slo import SloClass, SloClasses
from router.decision.load import Load
from router.decision.pool import HeldCounts, Worker
from router.settings import RouterOptions

__all__ = [
    "LOWER_CLASS_HEADROOM",
    "AdmissionLimits",
    "RequestKV",
    "TtftVerdict",
    "decode_is_full",
    "kv_room",
    "largest_request_tokens",
    "prefill_is_full",
    "ttft_verdict",
]

# A lower class is refused once a higher class's predicted TTFT passes this share of its target: the rest is
# the higher class's alone, so it is not the one refused when load rises.
LOWER_CLASS_HEADROOM = 0.8
# A request that would miss its target even alone may wait as long as its own prefill: its target is at least
# this many times its predicted TTFT on an idle worker.
QUEUE_ALLOWANCE = 2.0


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting: int = reg.ROUTER_ADMIT_MAX_WAITING.default  # per decode worker: requests waiting for a batch slot
    max_queued_prefill_tokens: int = reg.ROUTER_ADMIT_MAX_QUEUED_PREFILL_TOKENS.default
    queue_seconds: float = reg.ROUTER_ADMIT_QUEUE_SECONDS.default

    @classmethod
    def from_options(cls, opts: RouterOptions) -> AdmissionLimits:
        return cls(opts.admit_max_waiting, opts.admit_max_queued_prefill_tokens, opts.admit_queue_seconds)

    def queued_tokens_limit(self, w: Worker) -> int:
        """The floor, or the tokens `w` prefills in `queue_seconds` (GPU and CPU rates are orders apart)."""
        rate = w.load.prefill_tokens_per_s if w.load is not None else 0.0
        return max(self.max_queued_prefill_tokens, int(rate * self.queue_seconds))


@dataclass(slots=True)  # built per request (and per worker that trims it): a frozen one's __init__ costs ~3x
class RequestKV:
    """The KV one call reserves on its decode worker, and what its whole request (all n choices) reserves."""

    call_tokens: int  # prompt + max_tokens
    request_tokens: int  # n x (prompt + max_tokens), summed over the request's prompts
    output_tokens: int = 0  # the call's max_tokens (0: not told apart from the prompt)

    def on(self, load: Load) -> RequestKV:
        """What the request reserves on a worker with `load` (an optimistic one takes part of each output)."""
        allowance = load.kv_reserve_output_tokens
        if allowance <= 0 or self.output_tokens <= allowance:
            return self
        saved = self.output_tokens - allowance
        calls = max(1, round(self.request_tokens / self.call_tokens))  # n choices (and prompts) of this size
        return RequestKV(self.call_tokens - saved, self.request_tokens - calls * saved, allowance)


def largest_request_tokens(workers: Iterable[Worker]) -> int | None:
    """The most KV tokens one request may reserve on any of `workers` (None: no pool reported yet)."""
    caps = [_cap(w.load) for w in workers if w.load is not None and w.load.total_pages > 0]
    return max(caps) if caps else None


def concurrent_calls(workers: Iterable[Worker], limits: AdmissionLimits) -> int | None:
    """The most calls `workers` take at once: each its batch slots plus the waiting queue it keeps (as long as
    its batch, capped by the router's `max_waiting`); None while no worker has reported its batch size."""
    sizes = [w.load.max_running for w in workers if w.load is not None and w.load.max_running > 0]
    if not sizes:
        return None
    return sum(n + (min(n, limits.max_waiting) if limits.max_waiting else n) for n in sizes)


def kv_room(w: Worker, need: RequestKV, held: HeldCounts | None = None) -> bool:
    """Whether `w`'s pool takes the call and keeps as much free as the request takes (unknown pool: yes);
    `held`: `w.held()` where the caller has it."""
    load = w.load
    if load is None or load.total_pages <= 0:
        return True
    need = need.on(load)
    pool = load.total_pages * load.page_size
    free = load.free_pages * load.page_size - (held or w.held()).unseen_kv_tokens
    headroom = min(need.request_tokens, pool - _cap(load))
    return free - need.call_tokens >= headroom


def _cap(load: Load) -> int:
    pool = load.total_pages * load.page_size
    return min(pool, load.max_request_tokens) if load.max_request_tokens > 0 else pool


def decode_is_full(w: Worker, need: RequestKV, limits: AdmissionLimits, held: HeldCounts | None = None) -> bool:
    """Whether `w` takes no more decode calls now; `held`: `w.held()` where the caller has it."""
    load = w.load
    held = held or w.held()
    if load is None:
        return bool(limits.max_waiting) and max(0, held.inflight_requests) >= limits.max_waiting
    running, waiting = load.running_requests, load.waiting_requests
    free_slots = max(0, load.max_running - running)
    backlog = waiting + max(0, held.inflight_requests - running - waiting - free_slots)
    if limits.max_waiting and backlog >= limits.max_waiting:
        return True
    if limits.max_queued_prefill_tokens and load.queued_prefill_tokens >= limits.queued_tokens_limit(w):
        return True
    return not kv_room(w, need, held)


def prefill_is_full(w: Worker, limits: AdmissionLimits, held: HeldCounts | None = None) -> bool:
    """Whether `w` takes no more prompts now; `held`: `w.held()` where the caller has it."""
    if not limits.max_queued_prefill_tokens:
        return False
    queued = w.load.queued_prefill_tokens if w.load is not None else 0
    return max(queued, (held or w.held()).inflight_tokens) >= limits.queued_tokens_limit(w)


@dataclass(slots=True)  # one per request: a frozen one's __init__ costs ~3x
class TtftVerdict:
    """Whether a request is refused for TTFT, and what its 429 says."""

    shed: bool
    retry_after_s: int = 0  # ceil(excess), at least 1 (when shed)
    excess_s: float = 0.0  # how far the best placement's prediction is past the limit
    limiting_class: str = ""  # the class whose limit it passes (the request's own, or a higher one)
    predicted_s: float | None = None  # the best placement's predicted TTFT for the request's own class


def ttft_verdict(
    classes: SloClasses,
    cls: SloClass,
    best_ttft_s: Callable[[SloClass], float | None],
    alone_ttft_s: Callable[[SloClass], float | None] = lambda _k: None,
) -> TtftVerdict:
    """Refuses when no placement is predicted within class k's target. `best_ttft_s(k)`: the lowest predicted
    TTFT as class k (None: nothing predicted); `alone_ttft_s(k)`: with nothing queued ahead. A target never falls
    below QUEUE_ALLOWANCE times the request's cost alone."""
    own = best_ttft_s(cls)
    if cls.ttft_s is None:
        return TtftVerdict(False, 0, 0.0, "", own)  # positional: one a request, keywords cost its __init__ ~2x
    worst, limiting = 0.0, ""
    for k in classes.classes:
        if k.rank > cls.rank or k.ttft_s is None:
            continue
        best = own if k is cls else best_ttft_s(k)
        if best is None:
            continue
        limit = k.ttft_s if k is cls else LOWER_CLASS_HEADROOM * k.ttft_s
        if best - limit <= worst:
            continue  # the allowance only raises the limit: predicting alone cannot make this the worst excess
        alone = alone_ttft_s(k) or 0.0
        excess = best - max(limit, QUEUE_ALLOWANCE * alone)
        if excess > worst:
            worst, limiting = excess, k.name
    if not limiting:
        return TtftVerdict(False, 0, 0.0, "", own)  # positional: one a request, keywords cost its __init__ ~2x
    return TtftVerdict(True, max(1, math.ceil(worst)), worst, limiting, own)
