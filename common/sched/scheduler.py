"""One file because one class owns the request table, the page budget and the step in flight that every move changes.

The one scheduler every worker and the offline engine run: continuous batching over a paged KV pool and a
prefix cache, the host's work overlapped with the device's (docs/architecture.md, "The scheduler loop"). Its
parts with a job of their own live beside it: planning (step_plan.py), pacing (step_pacing.py), sampling
(step_sampling.py), pages (pages.py, prefill.py) and the request table (request_table.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.runner import ModelRunner
from common.kv.allocator import PageAllocator
from common.kv.host_tier import HostTier, make_host_tier
from common.kv.radix import RadixCache
from common.protocol import TokenLogprob
from common.sched.grammar import GrammarBook, GrammarError
from common.sched.grammar_compiles import GrammarCompiles
from common.sched.kv_connector import KVArrival, KVConnector
from common.sched.launched import Launched, StepTimer, copy_to_host
from common.sched.pages import KVBudget
from common.sched.prefill import PrefillAdder
from common.sched.prefill_budget import StepContext
from common.sched.prompt_scores import PromptScores, score_len
from common.sched.request import Req, ReqState
from common.sched.request_table import DuplicateRequest, RequestRejected, RequestTable
from common.sched.snapshot import SchedulerSnapshot
from common.sched.step_model import StepShape, chunk_attention
from common.sched.step_pacing import StepPacing
from common.sched.step_plan import PlanInputs, StepPlan, can_decode, decode_growth, plan
from common.sched.step_sampling import StepSampler
from common.sched.waiting import WaitingQueue
from common.settings import SchedulerConfig
from common.slo import parse_slo_classes

log = logging.getLogger("kvferry.sched")


@dataclass
class StepEvent:
    """What one step did for one request: tokens it produced, and whether it finished."""

    req: Req
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cfg: SchedulerConfig,
        eos_token_ids: tuple[int, ...] = (),
        overlap: bool | None = None,
        connector: KVConnector | None = None,
        defer_host_lock: bool = False,
    ) -> None:
        """`defer_host_lock`: the host KV tier is page-locked later, by whoever runs the steps (a worker's engine
        loop, in its idle turns: common/kv/host_tier.py `lock_some`); else here, before the first step."""
        self.runner = runner
        self.cfg = cfg
        self.eos = set(eos_token_ids or runner.model_config.eos_token_ids)
        self.page_size = runner.cfg.page_size
        if cfg.max_prefill_tokens < self.page_size:
            # Chunks end on page boundaries: a smaller budget could never admit a prompt longer than it.
            raise ValueError(f"max_prefill_tokens ({cfg.max_prefill_tokens}) must be >= page_size ({self.page_size})")
        if overlap is None and cfg.overlap != "auto":
            if cfg.overlap not in ("on", "off"):
                raise ValueError(f"overlap must be auto, on or off, not {cfg.overlap!r}")
            overlap = cfg.overlap == "on"
        if overlap is None:
            overlap = runner.device.type == "cuda" and runner.tp.size == 1
        if overlap and runner.tp.size > 1:
            raise ValueError("tensor-parallel followers need each step's token ids on the host: run overlap off")
        self.overlap = overlap
        self.device = runner.device
        self.allocator = PageAllocator(runner.pool.num_pages)
        self.cache: RadixCache | None = None
        if cfg.enable_prefix_cache:
            started = time.perf_counter()
            host = make_host_tier(runner.pool, cfg.host_kv_gb, runner.tp.size, defer_host_lock)  # None: none
            if host is not None:  # allocated, and page-locked unless deferred
                runner.start_phases.record("host_tier", time.perf_counter() - started)
            self.cache = RadixCache(self.page_size, self.allocator, host)
        self.budget = KVBudget(self.allocator, self.cache, runner.page_table, cfg.kv_reservation)
        self.park_preempted = self._park_preempted(cfg.preempt_mode)
        self.table = RequestTable()
        self.slo = parse_slo_classes(cfg.slo_classes, cfg.slo_default_class)
        self.max_running = runner.cfg.max_running
        self.vocab = runner.model_config.vocab_size
        self.grammars = GrammarBook(runner.model_path, self.vocab, tuple(self.eos))
        self.compiles = GrammarCompiles(self.grammars, cfg.grammar_compile_timeout_s)
        self._compile_failures: dict[str, str] = {}
        self.last_tokens = torch.zeros(runner.page_table.table.shape[0], dtype=torch.int64, device=self.device)
        self.sampler = StepSampler(runner.page_table.table.shape[0], self.vocab, self.device, tuple(self.eos))
        self._inflight: dict[Req, int] = {}  # tokens launched but not yet appended, per request
        self._pending: Launched | None = None
        self.last_plan: StepPlan | None = None  # what the last step was planned to compute, and why
        self._late: list[StepEvent] = []  # requests ended while sampling (a broken grammar), not yet returned
        self.prefill_tokens_launched = 0  # prompt tokens computed so far (the measured prefill rate's counter)
        self.pacing = StepPacing(cfg, self.page_size, self.slo, self.table)
        self.pacing.graphed_tokens = runner.graphed_step_tokens
        self.processed_kind: str | None = None  # kind of the step processed last ("prefill" | "decode" | "mixed")
        self._process_host_s = 0.0  # host seconds processing the last step took (Launched.process_host_s)
        self.connector: KVConnector = connector if connector is not None else KVConnector()
        self.recomputed_tokens = 0  # tokens prefilled again that had KV before a preemption

    def _park_preempted(self, mode: str) -> bool:
        """Whether a preempted request's KV is parked in the host tier (KVFERRY_PREEMPT_MODE)."""
        if mode not in ("auto", "recompute", "park"):
            raise ValueError(f"preempt mode must be auto, recompute or park, not {mode!r}")
        has_tier = self._host_tier is not None
        if mode == "park" and not has_tier:
            raise ValueError(
                "KVFERRY_PREEMPT_MODE=park needs a host KV tier (KVFERRY_HOST_KV_GB > 0, the prefix cache on, one "
                "tensor-parallel rank)"
            )
        return has_tier and mode != "recompute"

    # ---- the request table's indexes, read-only (the table moves requests) -------------------------
    @property
    def waiting(self) -> WaitingQueue:
        return self.table.waiting

    @property
    def running(self) -> list[Req]:
        return self.table.running

    @property
    def chunked(self) -> Req | None:
        return self.table.chunked

    @property
    def awaiting_kv(self) -> dict[str, Req]:
        return self.table.awaiting_kv

    @property
    def by_id(self) -> dict[str, Req]:
        return self.table.by_id

    @property
    def held(self) -> dict[str, tuple[Req, bool]]:
        return self.table.held

    def table_violations(self) -> list[str]:
        """Request table and page ledger violations (a pass over the pool: never per step)."""
        return self.table.violations(self.allocator, self.cache, self.runner.page_table, self.max_running)

    # ---- admission -------------------------------------------------------------------------------
    def validate(self, req: Req) -> None:
        try:
            cls = self.slo.get(req.sampling.slo_class)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        allowance_s = max(self.cfg.itl_delivery_ms, req.sampling.itl_allowance_ms) / 1000
        req.slo_rank, req.itl_target_s = cls.rank, cls.engine_itl_s(allowance_s)
        req.deadline_s = self.slo.queue_deadline(cls, time.monotonic())
        if req.max_device_len > self.runner.max_seq_len:
            raise RequestRejected(
                f"prompt ({req.prompt_len} tokens) plus max_tokens ({req.sampling.max_tokens}) exceeds the "
                f"context length of {self.runner.max_seq_len} tokens"
            )
        if self.budget.pages_for(req.max_device_len) > self.allocator.num_pages:
            raise RequestRejected(f"request needs more KV pages than the pool holds ({self.allocator.num_pages})")
        if any(t < 0 or t >= self.vocab for t in req.prompt_ids):
            raise RequestRejected("prompt contains token ids outside the vocabulary")
        if any(t >= self.vocab for t in req.sampling.logit_bias):
            raise RequestRejected(f"logit_bias token ids must be below the vocabulary size ({self.vocab})")
        spec = req.sampling.grammar
        if spec is not None and not self.grammars.cached(spec):
            try:
                self.grammars.check(spec)  # parse errors answer here (400); the slow compile runs off the loop
            except GrammarError as e:
                raise RequestRejected(str(e)) from None

    def add(self, req: Req) -> None:
        """Queues a request; one whose grammar is not compiled yet compiles off this thread first."""
        if req.req_id in self.by_id:
            raise DuplicateRequest(f"duplicate request id {req.req_id!r}")
        self.validate(req)
        spec = req.sampling.grammar
        if spec is not None and not self.grammars.cached(spec):
            self.table.add_compiling(req)
            self.compiles.start(req)
            return
        self.table.add_waiting(req)

    def prefetch_grammar(self, req: Req) -> None:
        """Compiles a request's grammar off this thread before its first token needs it."""
        spec = req.sampling.grammar
        if spec is not None and not self.grammars.cached(spec):
            self.compiles.prefetch(spec)

    def poll_compiles(self) -> None:
        """Queues the requests whose grammar compiled; failures wait for the owner to abort them."""
        ready, failed = self.compiles.collect()
        for req in ready:
            self.table.compiled(req)
        for req, error in failed:  # still COMPILING, never queued: `abort` ends it
            self._compile_failures[req.req_id] = error

    def take_compile_failures(self) -> list[tuple[str, str]]:
        return list(self._compile_failures.items())

    def compiling_only(self) -> bool:
        """Only grammar compiles are pending (the owner waits instead of spinning)."""
        return bool(self.compiles) and not (self.waiting or self.chunked or self.running or self._pending)

    def reserved_pages(self) -> int:
        return self.budget.reserved_pages(self.table.active())

    def _reserve(self, req: Req) -> list[int] | None:
        """Decode side: reserves `req`'s pages for a peer to write into; None when pages or a row are short."""
        self.validate(req)
        if req.req_id in self.by_id:
            raise DuplicateRequest(f"duplicate request id {req.req_id!r}")
        reserve = self.budget.reserve_len(req)
        if (
            self.runner.page_table.num_free_rows == 0
            or self.table.active_count() >= self.max_running
            or self.budget.pages_for(reserve) > self.budget.available_pages() - self.reserved_pages()
        ):
            return None
        req.reserve_len = reserve
        self.table.add_awaiting_kv(req)
        req.table_row = self.runner.page_table.take_row()
        self.budget.grow(req, req.prompt_len)
        return list(req.pages)

    def _admit_arrived(self, a: KVArrival) -> StepEvent:
        req = self.awaiting_kv[a.req_id]
        req.cached_len = req.prompt_len
        req.prefix_hit_len = a.cached_tokens
        if a.prompt_logprobs is not None:
            req.prompt_logprobs = a.prompt_logprobs
        self.table.start_running(req)
        event = StepEvent(req)
        self._append_token(req, a.token, a.logprob, event)
        return event

    def settle_transfers(self) -> list[StepEvent]:
        """Once per loop turn: ends finished transfers (returns arrived requests' first tokens), then reserves
        pages for requests a peer prefills, first come first served."""
        if not self.connector.transfers:
            return []
        events: list[StepEvent] = []
        done = self.connector.finished()
        if done:
            for rid in done.released:
                self._release_held(rid)
            for a in done.arrived:
                events.append(self._admit_arrived(a))
        for req in list(self.connector.reservations()):
            pages = self._reserve(req)
            if pages is None:
                break  # later requests wait behind this one
            self.connector.reserved(req, pages)
        return events

    # ---- abort / release ---------------------------------------------------------------------------
    def abort(self, req_id: str, reason: str = "abort", error: str | None = None) -> StepEvent | None:
        req = self.by_id.get(req_id)
        if req is None or req.finished:
            return None
        if req.state is ReqState.COMPILING:
            self.compiles.drop(req_id)
            self._compile_failures.pop(req_id, None)
        req.finish_reason = reason
        req.error = error
        if req.req_id in self.held:
            req.state = ReqState.FINISHED  # parked: its pages stay held until the connector releases them
        elif self.connector.transfers and self.connector.aborted(req):
            # A transfer may still touch these pages (a peer writing into them): they go back once it is over.
            self.table.hold(req, cache_kv=False, state=ReqState.FINISHED)
        else:
            self._finish(req, cache_kv=False)
        return StepEvent(req, finished=True)

    def _prefill_done(self, req: Req) -> None:
        """A prefill-only request's first token is sampled: held while a transfer reads its pages, else freed."""
        if self.connector.transfers and self.connector.prefill_done(req):
            self.table.hold(req, cache_kv=True)
        else:
            self.table.end(req)
            self._free(req, cache_kv=True)

    def _release_held(self, req_id: str) -> None:
        held = self.table.release(req_id)
        if held is not None:
            self._free(*held)

    def _free(self, req: Req, cache_kv: bool) -> None:
        if cache_kv:
            self.budget.cache_prefix(req, req.cached_len)
        self.budget.release(req)
        self.table.forget(req)

    def _finish(self, req: Req, cache_kv: bool = True) -> None:
        self.table.end(req)
        self._free(req, cache_kv)

    # ---- the loop ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.chunked or self.running or self._pending is not None or self.compiles)

    def step(self) -> list[StepEvent]:
        """Launches the next step and processes the one before it (overlap off: the one just launched)."""
        events: list[StepEvent] = []
        self.poll_compiles()
        started = time.perf_counter()
        launched = self._launch()
        if launched is not None:
            launched.launch_host_s, launched.process_host_s = time.perf_counter() - started, self._process_host_s
        self.pacing.next_launch_host_s = launched.launch_host_s if launched is not None else 0.0
        events += self.flush()
        if launched is not None and launched.logits is not None:
            if self.overlap:
                launched.masks = self.sampler.start_masks(launched.reqs, self.grammars)
            else:
                self._sample(launched)
        self._pending = launched
        if not self.overlap:
            events += self.flush()
        return self._with_late(events)

    def flush(self) -> list[StepEvent]:
        self._settle()
        launched, self._pending = self._pending, None
        if launched is None:
            return self._with_late([])
        launched.wait()
        started = time.perf_counter()
        events = self._process(launched)
        self._process_host_s = time.perf_counter() - started
        if not self.running:
            self.pacing.streams_ended()
        return self._with_late(events)

    def _with_late(self, events: list[StepEvent]) -> list[StepEvent]:
        if not self._late:
            return events
        late, self._late = self._late, []
        return late + events

    def _settle(self) -> None:
        """Samples the step in flight if it waited for grammar masks (the next forward reads its tokens)."""
        pending = self._pending
        if pending is not None and pending.logits is not None:
            self._sample(pending)

    def inflight(self, req: Req) -> int:
        return self._inflight.get(req, 0)

    # ---- launch ------------------------------------------------------------------------------------
    @property
    def mixed_batching(self) -> bool:
        return self.cfg.mixed_batching

    def plan_inputs(self) -> PlanInputs:
        return PlanInputs(
            running=self.running,
            chunked=self.chunked,
            waiting=self.waiting,
            inflight=self._inflight,
            max_seq_len=self.runner.max_seq_len,
            page_size=self.page_size,
            mixed_batching=self.mixed_batching,
            itl_target_s=self.pacing.budget_target_s(),
            budget=self.pacing.budget,
            spare_pages=self.budget.available_pages() - self.reserved_pages(),
            running_slots=min(self.max_running - self.table.active_count(), self.runner.page_table.num_free_rows),
            reserve_len=lambda r: r.reserve_len if r.table_row >= 0 else self.budget.reserve_len(r),
            peek=self.budget.peek,
        )

    @torch.inference_mode()
    def _launch(self) -> Launched | None:
        step = plan(self.plan_inputs())
        self.last_plan = step
        for r in step.preempt:
            self._preempt(r)
        if step.chunks:
            batch, chunks = self._take_chunks(step)
            if batch:
                if step.decode:
                    return self._launch_mixed(list(step.decode), batch, chunks)
                return self._launch_prefill(batch, chunks)
        decode = list(step.decode) if step.kind != "prefill" else self._decodable()
        return self._launch_decode(decode) if decode else None

    def _decodable(self) -> list[Req]:
        return [r for r in self.running if can_decode(r, self.inflight(r), self.runner.max_seq_len)]

    def _take_chunks(self, step: StepPlan) -> tuple[list[Req], list[int]]:
        """The plan's chunks, taken until one no longer fits (the prefix cache may have changed under the plan)."""
        ps = self.page_size
        growth = sum(decode_growth(r, self.inflight(r), r.reserve_len, ps) for r in step.decode)
        adder = PrefillAdder(
            budget=self.budget,
            page_table=self.runner.page_table,
            token_budget=step.token_budget,
            pages_available=self.budget.available_pages() - self.reserved_pages() - growth,
            running_slots=self.max_running - self.table.active_count(),
        )
        for c in step.chunks:
            if not c.admit:
                self.table.take_chunked()
                adder.add_continuing(c.req, c.tokens)
            elif adder.try_admit(c.req, c.tokens):
                self.table.admit(c.req)
            else:
                break
        return adder.batch, adder.chunks

    def _preempt(self, req: Req) -> None:
        """Frees a running request's pages and requeues it: its KV parked in the host tier and copied back on
        readmission, or left to the prefix cache and what eviction took of it recomputed (KVBudget.preempt)."""
        req.preempted_kv_len = req.cached_len
        parked = self.budget.preempt(req, self.park_preempted)
        req.cached_len = 0
        req.reserve_len = 0
        self.table.preempt(req, parked)

    def prefill_token_budget(self, decoding: bool | None = None, context: StepContext | None = None) -> int:
        """Prompt tokens the next step takes (common/sched/prefill_budget.py); `decoding` True: the budget beside
        decoding requests, as published."""
        if context is None:
            context = StepContext(len(self.running), sum(r.device_len for r in self.running))
        return self.pacing.budget(bool(self.running) if decoding is None else decoding, context)[0]

    def _decode_rows(self, batch: list[Req]) -> tuple[list[list[int]], list[int], bool]:
        """Each decode row's input id (-1: still on the device), its position, and whether any is on the device."""
        host_ids, positions, on_device = [], [], False
        for r in batch:
            k = self.inflight(r)
            pos = r.device_len + k - 1  # position of this step's input token
            self.budget.grow(r, pos + 1)
            positions.append(pos)
            host_ids.append([r.output_ids[-1] if k == 0 else -1])
            on_device |= k > 0
        return host_ids, positions, on_device

    def _device_inputs(self, fb: ForwardBatch, decode_rows: int, on_device: bool) -> None:
        if not on_device:
            return
        n = decode_rows
        ids = fb.input_ids[:n]
        ids = torch.where(ids < 0, self.last_tokens[fb.table_rows[:n]], ids)
        fb.input_ids = ids if fb.input_ids.shape[0] == n else torch.cat((ids, fb.input_ids[n:]))

    def _launch_prefill(self, batch: list[Req], chunks: list[int]) -> Launched:
        return self._launch_mixed([], batch, chunks)

    def _launch_mixed(self, decode: list[Req], batch: list[Req], chunks: list[int]) -> Launched:
        starts = [r.cached_len for r in batch]
        token_chunks = [r.fill_ids()[s : s + n] for r, s, n in zip(batch, starts, chunks)]
        done = [s + n == r.device_len for r, s, n in zip(batch, starts, chunks)]
        host_ids, positions, on_device = self._decode_rows(decode)
        self.prefill_tokens_launched += sum(chunks)
        scoring = any(r.scores_prompt for r in batch)
        scored = [score_len(r, s, n) for r, s, n in zip(batch, starts, chunks)] if scoring else []
        fb = self.runner.build_batch(
            host_ids + token_chunks,
            positions + starts,
            [r.table_row for r in decode] + [r.table_row for r in batch],
            [True] * len(decode) + done,
            is_decode=False,
            score_lens=[0] * len(decode) + scored if any(scored) else None,
        )
        self._settle()  # the step in flight's sampling (if it waited for masks) comes first on the stream
        self._device_inputs(fb, len(decode), on_device)
        timer = StepTimer.start(self.device)
        logits = self.runner.forward(fb)
        scores = None
        if fb.scored_rows:
            sampled = logits.shape[0] - fb.scored_rows
            reqs, at, counts = zip(*[(r, s, k) for r, s, k in zip(batch, starts, scored) if k])
            scores = PromptScores.compute(logits[sampled:], list(reqs), list(at), list(counts))
            logits = logits[:sampled]
        # Stopped before sampling records its event: a pending end event failed a mixed step under load.
        timer.stop()
        for r, s, n, d in zip(batch, starts, chunks, done):
            if s < r.preempted_kv_len:
                self.recomputed_tokens += min(s + n, r.preempted_kv_len) - s
            r.cached_len = s + n
            r.check()
            if not d:
                self.table.set_chunked(r)
        finishing = [r for r, d in zip(batch, done) if d]
        launched = self._begin_sampling("mixed" if decode else "prefill", decode + finishing, logits, len(decode))
        launched.chunks = [(r, s, s + n) for r, s, n in zip(batch, starts, chunks)]
        launched.scores = scores
        launched.timer = timer
        launched.shape = StepShape(
            sum(chunks),
            len(decode),
            sum(positions) + len(positions),
            sum(chunk_attention(st, n) for st, n in zip(starts, chunks)),
        )
        for r in finishing:
            if not r.prefill_only:
                self.budget.cache_prefix(r, r.cached_len)
                self.table.start_running(r)
        return launched

    def _launch_decode(self, batch: list[Req]) -> Launched:
        host_ids, positions, on_device = self._decode_rows(batch)
        fb = self.runner.build_batch(host_ids, positions, [r.table_row for r in batch], [True] * len(batch), True)
        self._settle()
        self._device_inputs(fb, len(batch), on_device)
        timer = StepTimer.start(self.device)
        logits = self.runner.forward(fb)
        timer.stop()
        launched = self._begin_sampling("decode", batch, logits, len(batch))
        launched.timer = timer
        launched.shape = StepShape(0, len(batch), sum(positions) + len(positions))
        return launched

    def _begin_sampling(self, kind: str, reqs: list[Req], logits: torch.Tensor, decode_rows: int) -> Launched:
        """Samples now unless a grammar row's previous token is still in flight: then after it is processed,
        before the next forward. The first `decode_rows` of `reqs` decode."""
        launched = Launched(kind, list(reqs), logits=logits, decode_rows=decode_rows)
        launched.rows = [r.table_row for r in reqs]
        launched.steps = [r.sampling.output_offset + len(r.output_ids) + self.inflight(r) for r in reqs]
        waits = any(r.sampling.grammar is not None and self.inflight(r) > 0 for r in reqs)
        for r in reqs:
            self._inflight[r] = self.inflight(r) + 1
        if not waits:
            self._sample(launched)
        return launched

    @torch.inference_mode()
    def _sample(self, launched: Launched) -> None:
        logits, launched.logits = launched.logits, None
        reqs = launched.reqs
        if reqs:
            assert logits is not None
            job, launched.masks = launched.masks, None
            out = self.sampler.sample(reqs, launched.rows, launched.steps, logits, self.grammars, job)
            res = out.result
            for r in out.broken:
                self._grammar_broken(r)
            self.last_tokens.index_copy_(0, out.rows_dev, res.tokens)
            launched.tokens = copy_to_host(res.tokens)
            launched.logprobs = copy_to_host(res.logprobs)
            launched.top_ids = copy_to_host(res.top_ids)
            launched.top_logprobs = copy_to_host(res.top_logprobs)
        launched.record_done(self.device)

    # ---- process -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _process(self, launched: Launched) -> list[StepEvent]:
        """A step the device has finished (`flush` waited for it): its tokens to the requests, and their events."""
        self.processed_kind = launched.kind
        self.pacing.observe(launched)
        if self.connector.transfers:
            for r, s, e in launched.chunks:
                if not r.finished:  # aborted while in flight: nothing to send on
                    self.connector.chunk_done(r, s, e)
        if launched.scores is not None:
            launched.scores.deliver()  # before the first token's event, which carries them
        if not launched.reqs:
            return []
        tokens = launched.tokens.tolist()
        chosen = launched.logprobs.tolist() if launched.logprobs is not None else None
        top_ids = launched.top_ids.tolist() if launched.top_ids is not None else None
        top_lp = launched.top_logprobs.tolist() if launched.top_logprobs is not None else None
        events: list[StepEvent] = []
        for i, r in enumerate(launched.reqs):
            k = self._inflight.pop(r, 1) - 1
            if k > 0:
                self._inflight[r] = k
            if r.finished:
                continue  # finished (stop token, abort) while this step was in flight: its token is void
            if i < launched.decode_rows and r.state is ReqState.RUNNING:  # (not preempted meanwhile)
                r.cached_len = r.device_len  # this step's input token now has its KV
            lp = None
            if chosen is not None and (r.sampling.logprobs or r.sampling.top_logprobs):
                n = r.sampling.top_logprobs
                top = list(zip(top_ids[i][:n], top_lp[i][:n])) if top_ids is not None and n else []
                lp = TokenLogprob(logprob=chosen[i], top=top)
            event = StepEvent(r)
            self._append_token(r, tokens[i], lp, event, decoded=i < launched.decode_rows)
            events.append(event)
            if i >= launched.decode_rows and r.prefill_only:
                self._prefill_done(r)
        return events

    def _append_token(
        self, req: Req, token: int, lp: TokenLogprob | None, event: StepEvent, decoded: bool = False
    ) -> None:
        """Appends a sampled token and decides whether the request finishes there. A grammar row's matcher
        accepts it here only if it may end the request; otherwise the next (batched, off-thread) mask fill does."""
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
        if req.sampling.grammar is not None and (reason is not None or not decoded or token in self.eos):
            if not self.grammars.advance(req):
                reason = "error"
                self._grammar_error(req)
            elif self.grammars.terminated(req):
                reason = "stop"
        if reason is not None:
            req.finish_reason = reason
            event.finished = True
            self._end(req)

    def _end(self, req: Req) -> None:
        if req.state in (ReqState.RUNNING, ReqState.WAITING):  # waiting: preempted with its last token in flight
            self._finish(req)
        else:
            self.table.end(req)

    def _grammar_error(self, req: Req) -> None:
        if self.grammars.dead_end(req):
            req.error = (
                "the request's grammar allows no token of this model's vocabulary "
                f"after {len(req.output_ids) - 1} generated tokens"
            )
            req.request_fault = True
        else:
            req.error = "a sampled token is outside the request's grammar"

    def _grammar_broken(self, req: Req) -> None:
        """A token appended earlier broke the grammar: the request ends there; its event goes with the next step's."""
        if req.finished:
            return
        req.finish_reason = "error"
        self._grammar_error(req)
        self._late.append(StepEvent(req, finished=True))
        self._end(req)

    # ---- the host KV tier's page-locking (deferred: `defer_host_lock`) ---------------------------------
    @property
    def _host_tier(self) -> HostTier | None:
        return self.cache.host if self.cache is not None else None

    def host_tier_locking(self) -> bool:
        """Whether the host KV tier still has memory to page-lock (until then the cache does not use it)."""
        host = self._host_tier
        return host is not None and not host.ready

    def lock_host_tier(self, budget_s: float, waiting: Callable[[], bool] | None = None) -> bool:
        """Page-locks more of the host KV tier, for about `budget_s` (at least one piece, none more once
        `waiting()`); True while some remain."""
        host = self._host_tier
        return host is not None and host.lock_some(budget_s, waiting)

    # ---- introspection -----------------------------------------------------------------------------
    def seed_prefill_speed(self, tokens_per_s: float) -> None:
        """A prefill speed measured before serving (the warm-up's full-size prompt alone): the budget's speed
        bound starts there, not at the first requests' (common/sched/prefill_budget.py)."""
        self.pacing.prefill_speed.seed_peak(tokens_per_s)

    def snapshot(self) -> SchedulerSnapshot:
        host = self._host_tier
        beside = self.running if self.mixed_batching else []  # prefill-first steps decode nothing
        host_cached = self.cache.host_cached_pages if self.cache is not None and host is not None else 0
        return SchedulerSnapshot(
            running=len(self.running) + len(self.awaiting_kv) + (1 if self.chunked is not None else 0),
            waiting=len(self.waiting) + len(self.compiles),
            held=len(self.held),
            queued_prefill_tokens=self.queued_prefill_tokens(),
            prefill_tokens_launched=self.prefill_tokens_launched,
            free_pages=self.free_pages() - self.reserved_pages(),
            total_pages=self.allocator.num_pages,
            prefill_chunk_tokens=self.prefill_token_budget(decoding=True) if self.mixed_batching else 0,
            itl_target_s=self.pacing.budget_target_s(),
            prefill_step_tokens_per_s=self.pacing.prefill_speed.tokens_per_s,
            step_coefficients=self.pacing.step_model.coefficients() if self.pacing.step_model.ready else {},
            step_chunk_tokens=self.prefill_token_budget(),
            decode_rows=len(beside),
            decode_context=sum(r.device_len for r in beside),
            queued_ahead_tokens=self.queued_ahead_tokens(),
            host_pages_cached=host_cached,
            host_pages_total=host.num_pages if host is not None else 0,
            host_pages_locked=host.num_pages - host.unlocked_pages if host is not None else 0,
            host_pages_saved=host.saved_pages if host is not None else 0,
            host_pages_loaded=host.loaded_pages if host is not None else 0,
            kv_reserve_output_tokens=self.budget.reserve_output_tokens,
            preemptions=self.table.preemptions,
            preemptions_parked=self.table.parked,
            step_overruns=self.pacing.itl_trim.overruns,
            step_stalls=self.pacing.itl_trim.stalls,
            recomputed_tokens=self.recomputed_tokens,
        )

    def last_step_kind(self) -> str | None:
        """Kind of the step processed last, read every step (a snapshot costs more)."""
        return self.processed_kind

    def has_request(self, req_id: str) -> bool:
        return req_id in self.by_id

    def live_request_ids(self) -> list[str]:
        return self.table.live_ids()

    def ledger_violations(self) -> list[str]:
        """Request table and page ledger violations (common/kv/integrity.py)."""
        return self.table_violations()

    def cached_block_hashes(self, tier: str = "device") -> list[int]:
        """The prefix cache's block hashes in `tier` (may raise RuntimeError if the tree changes: retry)."""
        return self.cache.all_block_hashes(tier) if self.cache is not None else []

    def take_index_events(self) -> list[tuple[str | None, list[int]]]:
        """The prefix cache's changes since the last call: (tier, hashes), tier None for evicted blocks."""
        return self.cache.drain_index_events() if self.cache is not None else []

    def queued_prefill_tokens(self) -> int:
        queued = sum(r.device_len for r in self.waiting)
        if self.chunked is not None:
            queued += self.chunked.prompt_len - self.chunked.cached_len
        return queued

    def queued_ahead_tokens(self) -> dict[str, int]:
        """Per SLO class, the prompt tokens an arrival now would wait behind (common/sched/waiting.py's order)."""
        now = time.monotonic()
        chunked = self.chunked.prompt_len - self.chunked.cached_len if self.chunked is not None else 0
        return {
            c.name: chunked + self.waiting.tokens_before(self.slo.queue_deadline(c, now), c.rank)
            for c in self.slo.classes
        }

    def free_pages(self) -> int:
        return self.budget.available_pages()
