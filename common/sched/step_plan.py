"""What the next step computes, decided by one pure function, `plan(PlanInputs) -> StepPlan`, which changes
nothing; the launch code executes it (computing less where the prefix cache changed under it, never more).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from common.sched.prefill_budget import StepContext
from common.sched.request import Req


class AdmitStop:
    QUEUE_EMPTY = "queue_empty"  # every waiting prompt joined (or none waits)
    TOKENS = "tokens"  # the token budget is spent (less than a page left for the next prompt)
    PAGES = "pages"  # the next prompt's reservation does not fit the pages not yet promised
    MAX_RUNNING = "max_running"  # as many requests are active as the engine batches
    IN_FLIGHT = "in_flight"  # the next prompt was preempted with a token in flight: it joins once that is read
    PREEMPTING = "preempting"  # this step preempts: nothing is admitted while memory is short


@dataclass(frozen=True)
class PromptChunk:
    req: Req
    tokens: int
    admit: bool  # taken from the waiting queue this step (False: the chunked prompt continuing)


@dataclass(frozen=True)
class StepPlan:
    kind: str  # "idle" | "decode" | "prefill" | "mixed"
    decode: tuple[Req, ...] = ()
    chunks: tuple[PromptChunk, ...] = ()
    token_budget: int = 0  # prompt tokens this step may take
    budget_reason: str = ""  # what sized it (common/sched/prefill_budget.py BudgetReason)
    admit_stop: str = AdmitStop.QUEUE_EMPTY
    preempt: tuple[Req, ...] = ()  # running requests sent back to the waiting queue before the step


@dataclass(frozen=True)
class PrefixPeek:
    tokens: int = 0  # tokens found (device and host tier)
    device_pages: int = 0  # pages of the hit already on the device (not allocated anew)
    lock_pages: int = 0  # evictable pages the hit stops being once locked (they leave the page budget)


@dataclass(frozen=True)
class PlanInputs:
    running: Sequence[Req]
    chunked: Req | None
    waiting: Sequence[Req]  # in the queue's order
    inflight: Mapping[Req, int]  # tokens launched but not yet read, per request
    max_seq_len: int
    page_size: int
    mixed_batching: bool  # False: prefill-first (a prompt's steps run before any decode step)
    itl_target_s: float
    # (decoding, context) -> (tokens, BudgetReason): the step-time model's budget
    budget: Callable[[bool, StepContext], tuple[int, str]]
    spare_pages: int  # pages neither used nor promised to an admitted request
    running_slots: int  # requests that may still be admitted (max_running and free table rows)
    reserve_len: Callable[[Req], int]  # tokens whose pages a request reserves when admitted (the memory policy)
    peek: Callable[[Req], PrefixPeek]


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def can_decode(r: Req, inflight: int, max_seq_len: int) -> bool:
    return len(r.output_ids) + inflight < r.sampling.max_tokens and r.device_len + inflight < max_seq_len


def preemptible(r: Req) -> bool:
    """Grammar requests (their matcher saw the tokens) and prompts prefilled for a peer are never preempted."""
    return r.sampling.grammar is None and not r.prefill_only


def victim_order(running: Sequence[Req]) -> list[Req]:
    """Who is preempted first: the lowest class, then the latest TTFT deadline."""
    return sorted((r for r in running if preemptible(r)), key=lambda r: (r.slo_rank, r.deadline_s), reverse=True)


def decode_growth(r: Req, inflight: int, reserve_len: int, page_size: int) -> int:
    have = max(len(r.pages), pages_for(reserve_len, page_size))
    return max(0, pages_for(r.device_len + inflight, page_size) - have)


def past_reservation(r: Req, reserve_len: int, page_size: int) -> bool:
    """Whether the request's next page comes from the spare pages (its pages reach its partial reservation)."""
    reserved = pages_for(reserve_len, page_size)
    return reserved < pages_for(r.max_device_len, page_size) and pages_for(r.device_len, page_size) >= reserved


def freed_by(r: Req, reserve_len: int, page_size: int) -> int:
    """Pages preempting `r` gives back, at least (shared prefix pages stay cached and are not counted)."""
    return len(r.pages) - r.tree_pages + max(0, pages_for(reserve_len, page_size) - len(r.pages))


def chunk_size(remaining: int, budget: int, page_size: int) -> int:
    """A prompt's next chunk: all of it if it fits, else whole pages."""
    return remaining if remaining <= budget else budget // page_size * page_size


def plan(v: PlanInputs) -> StepPlan:
    ps = v.page_size
    decode = [r for r in v.running if can_decode(r, v.inflight.get(r, 0), v.max_seq_len)]

    # Memory first: the decode rows' pages beyond their reservations, preempting while they do not fit.
    growth = {r: decode_growth(r, v.inflight.get(r, 0), v.reserve_len(r), ps) for r in decode}
    need = sum(growth.values())
    spare = v.spare_pages
    preempt: list[Req] = []
    if need > spare:
        for victim in victim_order(v.running):
            if need <= spare:
                break
            preempt.append(victim)
            spare += freed_by(victim, v.reserve_len(victim), ps)
            need -= growth.pop(victim, 0)
        decode = [r for r in decode if r not in preempt]
    spare -= need

    mixed = v.mixed_batching and bool(decode)
    if mixed and v.itl_target_s <= 0:
        # The target is measured first: one decode step (two with overlap) before the first mixed one.
        return StepPlan("decode", tuple(decode), preempt=tuple(preempt))
    if v.chunked is None and not v.waiting:
        return StepPlan("decode" if decode else "idle", tuple(decode), preempt=tuple(preempt))

    head = v.chunked if v.chunked is not None else v.waiting[0]
    context = StepContext(len(decode), sum(r.device_len for r in decode) if mixed else 0, head.cached_len)
    decoding = bool(decode) if v.mixed_batching else bool(v.running)
    budget, reason = v.budget(decoding, context)
    left = budget
    chunks: list[PromptChunk] = []
    if v.chunked is not None:
        n = chunk_size(v.chunked.device_len - v.chunked.cached_len, left, ps)
        if n > 0:
            chunks.append(PromptChunk(v.chunked, n, admit=False))
            left -= n
    stop = AdmitStop.PREEMPTING if preempt else AdmitStop.QUEUE_EMPTY
    slots = v.running_slots
    # An admission leaves a spare page for each decoding request past its reservation, or it would be preempted
    # back at its next page boundary, over and over while the pool is full.
    spare -= sum(1 for r in decode if past_reservation(r, v.reserve_len(r), ps))
    for req in () if preempt else v.waiting:
        if slots <= 0:
            stop = AdmitStop.MAX_RUNNING
            break
        if v.inflight.get(req, 0):
            stop = AdmitStop.IN_FLIGHT
            break
        hit = v.peek(req)
        pages = pages_for(v.reserve_len(req), ps) - hit.device_pages
        if pages + hit.lock_pages > spare:
            stop = AdmitStop.PAGES
            break
        remaining = req.device_len - hit.tokens
        n = chunk_size(remaining, left, ps)
        if n < remaining and n < ps:
            stop = AdmitStop.TOKENS
            break
        chunks.append(PromptChunk(req, n, admit=True))
        left -= n
        spare -= pages + hit.lock_pages
        slots -= 1

    if not chunks:
        return StepPlan("decode" if decode else "idle", tuple(decode), (), budget, reason, stop, tuple(preempt))
    rows = tuple(decode) if mixed else ()
    return StepPlan("mixed" if rows else "prefill", rows, tuple(chunks), budget, reason, stop, tuple(preempt))
