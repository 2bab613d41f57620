"""Admission: which workers can take one more request now, so overload is answered 429 + Retry-After
before latency collapses, instead of queueing without bound (or failing with 5xx).

A worker is *full* for a request when any of these holds (each threshold a ``KVFERRY_ROUTER_ADMIT_*``
setting, router/settings.py; 0 turns that check off):

decode worker d
    backlog_d = waiting_d + max(0, unseen_d - free_slots_d) >= admit_max_waiting
        unseen_d = max(0, inflight_d - running_d - waiting_d), free_slots_d = max_running_d - running_d
        Requests queued for admission on d: its last snapshot's waiting queue, plus the requests this
        router has open on d beyond what that snapshot shows (sent after it, or waiting for a remote
        prefill) that its free batch slots cannot take (with the slot count unreported, all of them:
        the pessimistic reading of a stale figure). Every waiting request adds about one request's
        worth of TTFT to those behind it, so a long queue is where latency collapses first.
    queued_prefill_tokens_d >= max(admit_max_queued_prefill_tokens, rate_d x admit_queue_seconds)
        Prompt tokens waiting for its prefill (short prompts and prefix hits prefill on the decode pod),
        against what the worker prefills within the TTFT target at its measured rate (``rate_d``: the
        worker's own ``prefill_tokens_per_s``, measured while prompts were queued), with a floor.
    free_d - need < min(request, pool_d - cap_d)
        free_d = free_pages_d * page_size - unseen_kv_d (the KV this router sent there since its last snapshot);
        need = prompt + max_tokens of this call, request = n x (prompt + max_tokens) of the whole request
        (a worker whose /load says it reserves only ``kv_reserve_output_tokens`` of an output: that many instead
        of max_tokens, as it counts its own free pages),
        cap_d = the most one request may reserve there (``max_request_tokens`` in its /load:
        KVFERRY_MAX_REQUEST_KV_SHARE of its pool). Decode pods reserve KV for the whole output, so a request
        that does not fit now would wait in the worker's queue, and the requests behind it with it. After
        its reservation at least as much must stay free as the request takes (at most what the share leaves
        of the pool): the largest requests never take the room a normal one needs, so a normal request
        beside any mix of large ones starts at once.

A request larger than ``cap_d`` on every ready decode worker can never be admitted: 400 (`check_request_kv`),
before anything is started.

prefill worker p
    max(queued_prefill_tokens_p, inflight_tokens_p) >= max(admit_max_queued_prefill_tokens, rate_p x admit_queue_seconds)
        The prefill queue in tokens (the pod's figure or this router's own count of prompt tokens sent
        and not yet started, whichever is larger): TTFT grows linearly with it.

the fleet, by predicted TTFT (``admit_by_ttft``; router/ttft_model.py predicts, `ttft_verdict` decides)
    min over placements of predicted_ttft(request as class k) > limit_k, for any class k with a TTFT target
    and rank <= the request's, where limit_k = max(ttft_k for the request's own class or LOWER_CLASS_HEADROOM x
    ttft_k for a higher class, QUEUE_ALLOWANCE x the request's predicted TTFT with nothing queued ahead)
        A request no worker (or prefill + decode pair) is predicted to serve within its class's TTFT target
        would only wait, and make the requests behind it wait: it is refused at once, before any worker is
        contacted, with ``Retry-After`` = ceil(predicted excess), at least 1 s (the queue ahead drains at the
        worker's own rate, so that is when the same request would fit). Lower classes go first: a request is
        also refused while a request of a higher class would be predicted past LOWER_CLASS_HEADROOM of that
        class's target, so the lower class stops adding work before the higher one starts missing, and a
        higher class is never refused while a lower one is admitted. A class without a TTFT target (batch)
        is never refused for TTFT: it queues. A worker that has measured nothing predicts nothing, and
        nothing is refused on a guess. The prediction counts the prompts queued ahead of the request in the
        worker's deadline order, those this router placed there since its last snapshot, and the request's own
        uncached tokens (the longest of its prompts). Shedding is for queues: a request that would miss its
        target even on an idle worker (a long prompt on a CPU) gains nothing from a 429, so it is held to
        QUEUE_ALLOWANCE (2) times its own predicted TTFT instead, and waits at most about its own prefill behind
        others.

The router routes among the workers that are not full. When every ready decode worker is full, or a
prompt long enough to disaggregate finds every prefill worker full, the request gets 429 with
``Retry-After`` (nothing was started anywhere). A worker that refuses a request itself (429: its engine
queue is full) is skipped and the request retried once on another, then answered 429 (router/upstream.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common.slo import SloClass, SloClasses
from router.pool import Load, Worker

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
    max_waiting: int = 32  # per decode worker: requests waiting for a batch slot
    max_queued_prefill_tokens: int = 32768  # per worker: prompt tokens waiting for prefill (the floor)
    queue_seconds: float = 2.0  # per worker: as many queued tokens as it prefills in this long, if more

    def queued_tokens_limit(self, w: Worker) -> int:
        """The floor, or the tokens the worker prefills in `queue_seconds` at its measured rate: an H200
        prefills 25-40k tokens/s of an 8B model, a CPU pod a few hundred, and one constant fits neither."""
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
