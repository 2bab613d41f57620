"""The scheduler both worker kinds run: continuous batching over a paged KV pool and a prefix cache."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.engine.runner import ModelRunner
from common.engine.sampling import SamplingBatch, sample
from common.kv.allocator import PageAllocator
from common.kv.radix import RadixCache
from common.protocol import TokenLogprob
from common.sched.pages import KVBudget
from common.sched.prefill import PrefillAdder
from common.sched.request import Req, ReqState

log = logging.getLogger("kvferry.sched")


class RequestRejected(ValueError):
    """A request that can never be served as asked (too long for the context or the KV pool)."""


@dataclass
class SchedulerConfig:
    max_prefill_tokens: int = 2048
    enable_prefix_cache: bool = True


@dataclass
class StepEvent:
    """What one step did for one request: tokens it produced, and whether it finished."""

    req: Req
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False


# Called after each prefill step for every request in it, with the token range whose KV is now complete.
ChunkHook = Callable[[Req, int, int], None]


class Scheduler:
    def __init__(self, runner: ModelRunner, cfg: SchedulerConfig, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.runner = runner
        self.cfg = cfg
        self.eos = set(eos_token_ids or runner.model_config.eos_token_ids)
        self.page_size = runner.cfg.page_size
        if cfg.max_prefill_tokens < self.page_size:
            # Chunks end on page boundaries: a smaller budget could never admit a prompt longer than it.
            raise ValueError(f"max_prefill_tokens ({cfg.max_prefill_tokens}) must be >= page_size ({self.page_size})")
        self.allocator = PageAllocator(runner.pool.num_pages)
        self.cache = RadixCache(self.page_size, self.allocator) if cfg.enable_prefix_cache else None
        self.budget = KVBudget(self.allocator, self.cache, runner.page_table)
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None
        self.running: list[Req] = []
        self.awaiting_kv: dict[str, Req] = {}
        self.by_id: dict[str, Req] = {}
        self.max_running = runner.cfg.max_running
        self.on_prefill_chunk: ChunkHook | None = None
        # When set, a request whose prompt is done (first token sampled) is handed to this callback and kept
        # out of decoding; the callback's owner calls `release` later (prefill workers: after the transfer).
        self.on_prefill_done: Callable[[Req], None] | None = None
        self.vocab = runner.model_config.vocab_size
        # Decode side: receives aborted requests whose pages a remote prefill may still write into.
        self.on_kv_abandoned: Callable[[Req], None] | None = None

    # ---- admission -------------------------------------------------------------------------------
    def validate(self, req: Req) -> None:
        if req.max_device_len > self.runner.max_seq_len:
            raise RequestRejected(
                f"prompt ({req.prompt_len} tokens) plus max_tokens ({req.sampling.max_tokens}) exceeds the "
                f"context length of {self.runner.max_seq_len} tokens"
            )
        if self.budget.pages_for(req.max_device_len) > self.allocator.num_pages:
            raise RequestRejected(f"request needs more KV pages than the pool holds ({self.allocator.num_pages})")
        if any(t < 0 or t >= self.vocab for t in req.prompt_ids):
            raise RequestRejected("prompt contains token ids outside the vocabulary")

    def add(self, req: Req) -> None:
        if req.req_id in self.by_id:
            raise RequestRejected(f"duplicate request id {req.req_id!r}")
        self.validate(req)
        self.by_id[req.req_id] = req
        self.waiting.append(req)

    def reserved_pages(self) -> int:
        """Pages promised to admitted requests but not yet allocated to them."""
        active = list(self.running) + list(self.awaiting_kv.values())
        if self.chunked is not None:
            active.append(self.chunked)
        return sum(self.budget.pages_for(r.max_device_len) - len(r.pages) for r in active)

    def reserve_for_remote_prefill(self, req: Req) -> torch.Tensor | None:
        """Decode side: reserves pages for `req`'s prompt (and its output budget) so a prefill peer can write
        its KV into them. Returns the prompt's page ids, or None when memory or a table row is short."""
        self.validate(req)
        if req.req_id in self.by_id:
            raise RequestRejected(f"duplicate request id {req.req_id!r}")
        need = self.budget.pages_for(req.max_device_len)
        if (
            self.runner.page_table.num_free_rows == 0
            or len(self.running) + len(self.awaiting_kv) >= self.max_running
            or need > self.budget.available_pages() - self.reserved_pages()
        ):
            return None
        req.table_row = self.runner.page_table.take_row()
        self.budget.grow(req, req.prompt_len)
        req.state = ReqState.AWAITING_KV
        self.awaiting_kv[req.req_id] = req
        self.by_id[req.req_id] = req
        return torch.tensor(req.pages, dtype=torch.int64)

    def admit_prefilled(
        self, req_id: str, first_token: int, logprob: TokenLogprob | None, cached_tokens: int
    ) -> StepEvent:
        """Decode side: the prompt's KV has arrived; the request joins the running batch with its first token."""
        req = self.awaiting_kv.pop(req_id)
        req.cached_len = req.prompt_len
        req.prefix_hit_len = cached_tokens
        req.state = ReqState.RUNNING
        self.running.append(req)
        event = StepEvent(req)
        self._append_token(req, first_token, logprob, event)
        return event

    # ---- abort / release ---------------------------------------------------------------------------
    def abort(self, req_id: str, reason: str = "abort", error: str | None = None) -> StepEvent | None:
        req = self.by_id.get(req_id)
        if req is None or req.finished:
            return None
        if req.state is ReqState.WAITING:
            self.waiting.remove(req)
        elif req is self.chunked:
            self.chunked = None
        elif req.state is ReqState.AWAITING_KV:
            self.awaiting_kv.pop(req_id, None)
        elif req in self.running:
            self.running.remove(req)
        req.finish_reason = reason
        req.error = error
        if req.state is ReqState.AWAITING_KV and self.on_kv_abandoned is not None:
            # A prefill peer may still be writing into these pages: their owner frees them once it is safe.
            req.state = ReqState.FINISHED
            self.on_kv_abandoned(req)
        else:
            self._finish(req, cache_kv=False)
        return StepEvent(req, finished=True)

    def free_abandoned(self, req: Req) -> None:
        """Frees the pages of a request handed to `on_kv_abandoned` (no prefix caching: its KV is partial)."""
        self.budget.release(req)
        self.by_id.pop(req.req_id, None)

    def release(self, req: Req) -> None:
        """Frees a request's pages (for requests parked by `on_prefill_done`)."""
        self.budget.cache_prefix(req, req.cached_len)
        self.budget.release(req)
        self.by_id.pop(req.req_id, None)

    def _finish(self, req: Req, cache_kv: bool = True) -> None:
        req.state = ReqState.FINISHED
        if cache_kv:
            self.budget.cache_prefix(req, req.cached_len)
        self.budget.release(req)
        self.by_id.pop(req.req_id, None)

    # ---- stepping ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.chunked or self.running)

    def step(self) -> list[StepEvent]:
        adder = self._schedule_prefill()
        if adder is not None and adder.batch:
            return self._run_prefill(adder.batch, adder.chunks)
        if self.running:
            return self._run_decode()
        return []

    def _schedule_prefill(self) -> PrefillAdder | None:
        if not self.waiting and self.chunked is None:
            return None
        adder = PrefillAdder(
            budget=self.budget,
            page_table=self.runner.page_table,
            token_budget=self.cfg.max_prefill_tokens,
            pages_available=self.budget.available_pages() - self.reserved_pages(),
            running_slots=self.max_running - len(self.running) - len(self.awaiting_kv) - (1 if self.chunked else 0),
        )
        if self.chunked is not None:
            adder.add_continuing(self.chunked)
            self.chunked = None
        while self.waiting and adder.try_admit(self.waiting[0]):
            self.waiting.popleft()
        return adder

    def _run_prefill(self, batch: list[Req], chunks: list[int]) -> list[StepEvent]:
        starts = [r.cached_len for r in batch]
        token_chunks = [r.prompt_ids[s : s + n] for r, s, n in zip(batch, starts, chunks)]
        done = [s + n == r.prompt_len for r, s, n in zip(batch, starts, chunks)]
        fb = self.runner.build_batch(token_chunks, starts, [r.table_row for r in batch], done, is_decode=False)
        logits = self.runner.forward(fb)
        finishing = [r for r, d in zip(batch, done) if d]
        events: list[StepEvent] = []
        for r, s, n, d in zip(batch, starts, chunks, done):
            r.cached_len = s + n
            r.check()
            if self.on_prefill_chunk is not None:
                self.on_prefill_chunk(r, s, s + n)
            if not d:
                assert self.chunked is None, "one chunked request at a time"
                self.chunked = r
        if finishing:
            events = self._sample_and_append(finishing, logits)
            for r in finishing:
                if self.on_prefill_done is not None:
                    self.budget.cache_prefix(r, r.prompt_len)
                    self.on_prefill_done(r)
                elif not r.finished:
                    self.budget.cache_prefix(r, r.prompt_len)
                    r.state = ReqState.RUNNING
                    self.running.append(r)
        return events

    def _run_decode(self) -> list[StepEvent]:
        batch = list(self.running)
        for r in batch:
            self.budget.grow(r, r.device_len)
        starts = [r.device_len - 1 for r in batch]
        token_chunks = [[r.output_ids[-1]] for r in batch]
        fb = self.runner.build_batch(token_chunks, starts, [r.table_row for r in batch], [True] * len(batch), True)
        logits = self.runner.forward(fb)
        for r in batch:
            r.cached_len = r.device_len
        return self._sample_and_append(batch, logits)

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> list[StepEvent]:
        sb = SamplingBatch.build(
            [r.sampling for r in reqs], [r.seed for r in reqs], [r.output_ids for r in reqs], self.vocab, logits.device
        )
        res = sample(logits, sb)
        tokens = res.tokens.tolist()
        chosen = res.logprobs.tolist() if res.logprobs is not None else None
        top_ids = res.top_ids.tolist() if res.top_ids is not None else None
        top_lp = res.top_logprobs.tolist() if res.top_logprobs is not None else None
        events = []
        for i, r in enumerate(reqs):
            lp = None
            if chosen is not None and (r.sampling.logprobs or r.sampling.top_logprobs):
                n = r.sampling.top_logprobs
                top = list(zip(top_ids[i][:n], top_lp[i][:n])) if top_ids is not None and n else []
                lp = TokenLogprob(logprob=chosen[i], top=top)
            event = StepEvent(r)
            self._append_token(r, tokens[i], lp, event)
            events.append(event)
        return events

    def _append_token(self, req: Req, token: int, lp: TokenLogprob | None, event: StepEvent) -> None:
        req.output_ids.append(token)
        req.device_len += 1
        if lp is not None:
            req.output_logprobs.append(lp)
            event.logprobs.append(lp)
        event.tokens.append(token)
        req.check()
        reason = None
        if (token in self.eos and not req.sampling.ignore_eos) or token in req.sampling.stop_token_ids:
            reason = "stop"
        elif len(req.output_ids) >= req.sampling.max_tokens or req.device_len >= self.runner.max_seq_len:
            reason = "length"
        if reason is not None:
            req.finish_reason = reason
            event.finished = True
            if req in self.running:
                self.running.remove(req)
            if self.on_prefill_done is None or req.state is ReqState.RUNNING:
                self._finish(req)
            else:
                # Prefill-only mode: the owner releases after sending the KV onwards.
                req.state = ReqState.FINISHED

    # ---- introspection -----------------------------------------------------------------------------
    def queued_prefill_tokens(self) -> int:
        queued = sum(r.prompt_len for r in self.waiting)
        if self.chunked is not None:
            queued += self.chunked.prompt_len - self.chunked.cached_len
        return queued

    def free_pages(self) -> int:
        return self.budget.available_pages()
