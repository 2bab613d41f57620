"""Admission: which workers can take one more request now, so overload is answered 429 + Retry-After
before latency collapses, not queued without bound.

A worker is *full* for a request when any of these holds (thresholds: ``KVFERRY_ROUTER_ADMIT_*``; 0 turns a
check off):

decode worker d
    backlog_d = waiting_d + max(0, unseen_d - free_slots_d) >= admit_max_waiting
        unseen_d = max(0, inflight_d - running_d - waiting_d), free_slots_d = max_running_d - running_d
        Its snapshot's waiting queue plus the requests this router sent since that its free batch slots cannot
        take (all of them when the slot count is unreported). Each waiting request adds about one request's
        TTFT to those behind it: a long queue is where latency collapses first.
    queued_prefill_tokens_d >= max(admit_max_queued_prefill_tokens, rate_d x admit_queue_seconds)
        Prompt tokens waiting for its prefill against what it prefills in that time at its own measured rate.
    free_d - need < min(request, pool_d - cap_d)
        free_d = free_pages_d * page_size - unseen_kv_d (KV this router sent since the snapshot); need =
        prompt + max_tokens of this call (``kv_reserve_output_tokens`` of the output where the worker reserves
        only that); request = n x that; cap_d = ``max_request_tokens`` from its /load. A decode pod reserves
        the whole output, so a request that does not fit would wait in its queue with those behind it; and as
        much must stay free as the request takes, so large requests never take a normal one's room.

A request larger than ``cap_d`` on every ready decode worker can never run: 400 (`check_request_kv`).

prefill worker p
    max(queued_prefill_tokens_p, inflight_tokens_p) >= max(admit_max_queued_prefill_tokens, rate_p x admit_queue_seconds)
        The prefill queue in tokens (the pod's or this router's count, the larger): TTFT grows linearly with it.

the fleet, by predicted TTFT (``admit_by_ttft``; router/decision/ttft_model.py predicts, `ttft_verdict` decides)
    min over placements of predicted_ttft(request as class k) > limit_k, for any class k with a TTFT target
    and rank <= the request's, where limit_k = max(ttft_k for the request's own class or LOWER_CLASS_HEADROOM x
    ttft_k for a higher class, QUEUE_ALLOWANCE x the request's predicted TTFT with nothing queued ahead)
        A request no placement would serve within target would only wait and delay those behind it: it is
        refused before any worker is contacted, ``Retry-After`` = ceil(predicted excess) (the queue drains at
        the worker's rate), at least 1 s. Lower classes are refused first, once a higher class nears its
        target, so a higher class is never refused while a lower one is admitted. A class without a TTFT
        target queues; a worker that has measured nothing predicts nothing, and nothing is refused on a
        guess. A request that would miss even on an idle worker gains nothing from a 429: QUEUE_ALLOWANCE
        bounds its wait to about its own prefill.

The router routes among workers that are not full; when none is (decode, or prefill for a prompt long enough
to disaggregate), 429 with ``Retry-After``, nothing started. A worker that answers 429 itself is skipped and
the request retried once elsewhere (router/upstream/call.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common import settings_registry as reg
from common.slo import SloClass, SloClasses
from router.decision.pool import Load, Worker
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

# A lower class is refused once a higher class's predicted TTFT passes this share of that class's target: the
# rest is the higher class's alone, so it is not the one refused when load rises (a lower-class request queued
# behind it still reaches the front once its own, later deadline comes).
LOWER_CLASS_HEADROOM = 0.8
# A request that would miss its target even alone may still wait behind others as long as its own prefill takes:
# the target it is held to is at least this many times its predicted TTFT on an idle worker.
QUEUE_ALLOWANCE = 2.0


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting: int = reg.ROUTER_ADMIT_MAX_WAITING.default  # per decode worker: requests waiting for a batch slot
    # per worker: prompt tokens waiting for prefill (the floor)
    max_queued_prefill_tokens: int = reg.ROUTER_ADMIT_MAX_QUEUED_PREFILL_TOKENS.default
    # per worker: as many queued tokens as it prefills in this long, if more
    queue_seconds: float = reg.ROUTER_ADMIT_QUEUE_SECONDS.default

    @classmethod
    def from_options(cls, opts: RouterOptions) -> AdmissionLimits:
        return cls(opts.admit_max_waiting, opts.admit_max_queued_prefill_tokens, opts.admit_queue_seconds)

    def queued_tokens_limit(self, w: Worker) -> int:
        """The floor, or the tokens the worker prefills in `queue_seconds` at its measured rate: GPU and CPU
        pods prefill at rates orders of magnitude apart, and one constant fits neither."""
        rate = w.load.prefill_tokens_per_s if w.load is not None else 0.0
        return max(self.max_queued_prefill_tokens, int(rate * self.queue_seconds))


@dataclass(frozen=True)
class RequestKV:
    """The KV one call reserves on its decode worker, and what its whole request (all n choices) reserves."""

    call_tokens: int  # prompt + max_tokens
    request_tokens: int  # n x (prompt + max_tokens), summed over the request's prompts
    output_tokens: int = 0  # the call's max_tokens (0: not told apart from the prompt)

    def on(self, load: Load) -> RequestKV:
        """What the request reserves on a worker with `load`: there an optimistic reservation takes its prompts
        and `kv_reserve_output_tokens` of each output, not all of max_tokens (common/sched/pages.py)."""
        allowance = load.kv_reserve_output_tokens
        if allowance <= 0 or self.output_tokens <= allowance:
            return self
        saved = self.output_tokens - allowance
        calls = max(1, round(self.request_tokens / self.call_tokens))  # n choices (and prompts) of this size
        return RequestKV(self.call_tokens - saved, self.request_tokens - calls * saved, allowance)


def largest_request_tokens(workers: Iterable[Worker]) -> int | None:
    """The most KV tokens one request may reserve on any of `workers` (None: none has reported its pool yet)."""
    caps = [_cap(w.load) for w in workers if w.load is not None and w.load.total_pages > 0]
    return max(caps) if caps else None


def kv_room(w: Worker, need: RequestKV) -> bool:
    """Whether `w`'s KV pool takes the call now and keeps as much free as the request takes, at most what the
    per-request share leaves of the pool (an unknown pool: yes, the worker refuses what it cannot hold)."""
    load = w.load
    if load is None or load.total_pages <= 0:
        return True
    need = need.on(load)
    pool = load.total_pages * load.page_size
    free = load.free_pages * load.page_size - w.unseen_kv_tokens
    headroom = min(need.request_tokens, pool - _cap(load))
    return free - need.call_tokens >= headroom


def _cap(load: Load) -> int:
    pool = load.total_pages * load.page_size
    return min(pool, load.max_request_tokens) if load.max_request_tokens > 0 else pool


def decode_is_full(w: Worker, need: RequestKV, limits: AdmissionLimits) -> bool:
    load = w.load
    running, waiting = (load.running_requests, load.waiting_requests) if load is not None else (0, 0)
    free_slots = max(0, load.max_running - running) if load is not None else 0
    backlog = waiting + max(0, w.inflight_requests - running - waiting - free_slots)
    if limits.max_waiting and backlog >= limits.max_waiting:
        return True
    if load is None:
        return False
    if limits.max_queued_prefill_tokens and load.queued_prefill_tokens >= limits.queued_tokens_limit(w):
        return True
    return not kv_room(w, need)


def prefill_is_full(w: Worker, limits: AdmissionLimits) -> bool:
    if not limits.max_queued_prefill_tokens:
        return False
    queued = w.load.queued_prefill_tokens if w.load is not None else 0
    return max(queued, w.inflight_tokens) >= limits.queued_tokens_limit(w)


@dataclass(frozen=True)
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
    """The fleet rule of the module docstring. `best_ttft_s(k)`: the lowest predicted TTFT over the placements
    of this request as a request of class k (None: nothing predicted); `alone_ttft_s(k)`: the same with nothing
    queued ahead. A class's target never falls below QUEUE_ALLOWANCE times what the request costs alone: one
    that cannot meet the target even on an idle worker (a long prompt on a CPU) is served as well as it can be,
    and shed only for a queue that would keep it waiting longer than its own prefill."""
    own = best_ttft_s(cls)
    if cls.ttft_s is None:
        return TtftVerdict(False, predicted_s=own)
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
        return TtftVerdict(False, predicted_s=own)
    return TtftVerdict(True, max(1, math.ceil(worst)), worst, limiting, own)
