"""The overlapped scheduler: the CPU schedules and launches step N+1 while the device still runs step N.

`step()` launches the next batch, then processes the previous one. A request's progress is decided at
launch: the lengths that do not depend on the sampled token (its KV position, its pages, its next chunk)
move then, and the token itself is appended when its step is processed. Sampled tokens stay on the
device: they are written into `last_tokens[table_row]`, and the next decode step reads its input ids
from there, so a step never waits for the host to learn the previous step's tokens. The only wait is
on the copy-done event of the step being processed (its tokens copied into pinned host memory).

Everything runs on one CUDA stream, so a request that finishes at step N (a stop token, found when N is
processed, after N+1 was launched) is harmless: N+1 writes its KV for it into pages that step N+2,
launched later on the same stream, may hand to a new request; N+1's output for it is discarded.
Finishing by length is known at launch, so such requests are never launched past their last token.
With `overlap=False` each step is processed right after its launch (the same code, for the ablation).
Requests with frequency/presence penalties need their whole output on the host: while one runs, the
in-flight step is processed before the next launch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from common.engine.runner import ModelRunner
from common.engine.sampling import SamplingBatch, sample
from common.protocol import TokenLogprob
from common.sched.request import Req, ReqState
from common.sched.scheduler import Scheduler, SchedulerConfig, StepEvent


@dataclass
class _Launched:
    """A step on the device whose sampled tokens are not yet known to the host."""

    kind: str  # "prefill" | "decode"
    reqs: list[Req]  # requests that sample a token in this step, in sampling order
    tokens: torch.Tensor  # [R] int64, host (pinned on CUDA)
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    done: torch.cuda.Event | None
    chunks: list[tuple[Req, int, int]]  # prefill: (request, start, end) of each chunk computed


def _needs_penalty(r: Req) -> bool:
    return bool(r.sampling.frequency_penalty or r.sampling.presence_penalty)


class OverlapScheduler(Scheduler):
    def __init__(
        self,
        runner: ModelRunner,
        cfg: SchedulerConfig,
        eos_token_ids: tuple[int, ...] = (),
        overlap: bool = True,
    ) -> None:
        super().__init__(runner, cfg, eos_token_ids)
        self.overlap = overlap
        self.device = runner.device
        self._cuda = self.device.type == "cuda"
        # The newest sampled token of each table row, on the device (the next decode step's input).
        self.last_tokens = torch.zeros(runner.page_table.table.shape[0], dtype=torch.int64, device=self.device)
        self._inflight: dict[Req, int] = {}  # tokens launched but not yet appended, per request
        self._pending: _Launched | None = None

    # ---- the loop ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return super().has_work() or self._pending is not None

    def step(self) -> list[StepEvent]:
        events: list[StepEvent] = []
        if self._pending is not None and any(_needs_penalty(r) for r in self.running):
            events += self._drain()
        launched = self._launch()
        events += self._drain()
        self._pending = launched
        if launched is not None and not self.overlap:
            events += self._drain()
        return events

    def flush(self) -> list[StepEvent]:
        """Processes the step in flight, if any (before reading every request's final state)."""
        return self._drain()

    def _drain(self) -> list[StepEvent]:
        launched, self._pending = self._pending, None
        return self._process(launched) if launched is not None else []

    def inflight(self, req: Req) -> int:
        return self._inflight.get(req, 0)

    # ---- launch ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _launch(self) -> _Launched | None:
        adder = self._schedule_prefill()
        if adder is not None and adder.batch:
            return self._launch_prefill(adder.batch, adder.chunks)
        batch = [r for r in self.running if self._can_decode(r)]
        if batch:
            return self._launch_decode(batch)
        return None

    def _can_decode(self, r: Req) -> bool:
        k = self.inflight(r)
        return len(r.output_ids) + k < r.sampling.max_tokens and r.device_len + k < self.runner.max_seq_len

    def _launch_prefill(self, batch: list[Req], chunks: list[int]) -> _Launched:
        starts = [r.cached_len for r in batch]
        token_chunks = [r.prompt_ids[s : s + n] for r, s, n in zip(batch, starts, chunks)]
        done = [s + n == r.prompt_len for r, s, n in zip(batch, starts, chunks)]
        rows = [r.table_row for r in batch]
        fb = self.runner.build_batch(token_chunks, starts, rows, done, is_decode=False)
        logits = self.runner.forward(fb)
        for r, s, n, d in zip(batch, starts, chunks, done):
            r.cached_len = s + n
            r.check()
            if not d:
                assert self.chunked is None, "one chunked request at a time"
                self.chunked = r
        finishing = [r for r, d in zip(batch, done) if d]
        launched = self._sample("prefill", finishing, logits, [r.table_row for r in finishing] if finishing else [])
        launched.chunks = [(r, s, s + n) for r, s, n in zip(batch, starts, chunks)]
        if self.on_prefill_done is None:
            for r in finishing:
                # Joins the running batch now: the next decode step reads its first token on the device.
                self.budget.cache_prefix(r, r.prompt_len)
                r.state = ReqState.RUNNING
                self.running.append(r)
        return launched

    def _launch_decode(self, batch: list[Req]) -> _Launched:
        positions = []
        host_ids = []
        on_device = []
        for r in batch:
            k = self.inflight(r)
            pos = r.device_len + k - 1  # position of this step's input token
            self.budget.grow(r, pos + 1)
            positions.append(pos)
            host_ids.append([r.output_ids[-1] if k == 0 else 0])
            on_device.append(k > 0)
        rows = [r.table_row for r in batch]
        fb = self.runner.build_batch(host_ids, positions, rows, [True] * len(batch), is_decode=True)
        if any(on_device):
            mask = torch.tensor(on_device, dtype=torch.bool).to(self.device, non_blocking=True)
            fb.input_ids = torch.where(mask, self.last_tokens[fb.table_rows], fb.input_ids)
        logits = self.runner.forward(fb)
        return self._sample("decode", batch, logits, rows)

    def _sample(self, kind: str, reqs: list[Req], logits: torch.Tensor, rows: list[int]) -> _Launched:
        if not reqs:
            return _Launched(kind, [], torch.empty(0, dtype=torch.int64), None, None, None, None, [])
        penalties = any(_needs_penalty(r) for r in reqs)
        sb = SamplingBatch.build(
            [r.sampling for r in reqs],
            [r.seed for r in reqs],
            [r.output_ids for r in reqs] if penalties else [[] for _ in reqs],
            self.vocab,
            torch.device("cpu"),
        )
        sb.steps = torch.tensor([len(r.output_ids) + self.inflight(r) for r in reqs], dtype=torch.int64)
        sb = _to_device(sb, self.device)
        res = sample(logits, sb)
        rows_dev = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        self.last_tokens.index_copy_(0, rows_dev, res.tokens)
        launched = _Launched(
            kind,
            list(reqs),
            self._to_host(res.tokens),
            self._to_host(res.logprobs),
            self._to_host(res.top_ids),
            self._to_host(res.top_logprobs),
            None,
            [],
        )
        if self._cuda:
            launched.done = torch.cuda.Event()
            launched.done.record()
        for r in reqs:
            self._inflight[r] = self.inflight(r) + 1
        return launched

    def _to_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not self._cuda:
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    # ---- process -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _process(self, launched: _Launched) -> list[StepEvent]:
        if launched.done is not None:
            launched.done.synchronize()
        if self.on_prefill_chunk is not None:
            for r, s, e in launched.chunks:
                if not r.finished:  # aborted while in flight: nothing to send on
                    self.on_prefill_chunk(r, s, e)
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
            if launched.kind == "decode":
                r.cached_len = r.device_len  # this step's input token now has its KV
            lp = None
            if chosen is not None and (r.sampling.logprobs or r.sampling.top_logprobs):
                n = r.sampling.top_logprobs
                top = list(zip(top_ids[i][:n], top_lp[i][:n])) if top_ids is not None and n else []
                lp = TokenLogprob(logprob=chosen[i], top=top)
            event = StepEvent(r)
            self._append_token(r, tokens[i], lp, event)
            events.append(event)
            if launched.kind == "prefill" and self.on_prefill_done is not None:
                self.budget.cache_prefix(r, r.prompt_len)
                self.on_prefill_done(r)
        return events


def _to_device(sb: SamplingBatch, device: torch.device) -> SamplingBatch:
    """Moves a host-built sampling batch with non-blocking copies (a blocking one would wait for the stream)."""
    if device.type == "cpu":
        return sb
    moved = {}
    for f in dataclasses.fields(sb):
        v = getattr(sb, f.name)
        if isinstance(v, torch.Tensor):
            moved[f.name] = v.pin_memory().to(device, non_blocking=True)
    return dataclasses.replace(sb, **moved)
