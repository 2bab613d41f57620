"""Each step's sampling inputs: per-row parameters written once into device tensors at a request's first
sampling and gathered per step (reused as is while the batch is unchanged, so host work does not grow with it);
what changes per step travels in the step's one staged copy. Grammar masks are filled on a thread of their own
(`start_masks`; xgrammar releases the GIL) while the scheduler plans the next step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from common.engine.sampling import (
    FLOAT_PARAMS,
    INT_PARAMS,
    BatchFlags,
    SampleResult,
    SamplingBatch,
    sample,
    slot_values,
    sparse_additions,
)
from common.engine.staging import HostToDevice, Stage
from common.protocol import SamplingParams
from common.sched.grammar import GrammarBook, GrammarMasks
from common.sched.penalties import PenaltyBatch, PenaltyHistory, PenaltyPlan
from common.sched.request import Req


@dataclass(eq=False)
class _Batch:
    reqs: tuple[Req, ...]
    rows_dev: torch.Tensor  # [B] int64 table rows
    floats: torch.Tensor  # [B, len(FLOAT_PARAMS)]
    ints: torch.Tensor  # [B, len(INT_PARAMS)]
    flags: BatchFlags
    penalty: PenaltyBatch | None  # some row has a frequency, presence or repetition penalty
    grammar: bool  # some row has a grammar
    additions: list[int]  # rows with a logit_bias or min_tokens (their additions are decided per step)
    add_key: tuple[bool, ...] | None = None  # which of `additions` had their bans last step
    add_dev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # those additions on the device


@dataclass(eq=False)
class MaskJob:
    stage: Stage
    part: int
    masks: Future[GrammarMasks]


@dataclass
class Sampled:
    result: SampleResult
    rows_dev: torch.Tensor  # the batch's table rows on the device
    broken: list[Req]  # grammar requests whose last token their grammar did not allow (found by the fill)


class StepSampler:
    def __init__(
        self,
        rows: int,
        vocab: int,
        device: torch.device,
        eos_ids: Sequence[int],
    ) -> None:
        self.vocab = vocab
        self.device = device
        self.eos_ids = tuple(eos_ids)
        self.penalties = PenaltyHistory(rows, vocab, device)
        self.h2d = HostToDevice(device)
        self.floats = torch.zeros(rows, len(FLOAT_PARAMS), dtype=torch.float32, device=device)
        self.ints = torch.zeros(rows, len(INT_PARAMS), dtype=torch.int64, device=device)
        self._owner: list[weakref.ref[Req] | None] = [None] * rows
        self._last: _Batch | None = None
        self._fill_thread: ThreadPoolExecutor | None = None

    def _has_grammar(self, reqs: Sequence[Req]) -> bool:
        last = self._last
        if last is not None and last.reqs == tuple(reqs):
            return last.grammar
        return any(r.sampling.grammar is not None for r in reqs)

    def start_masks(self, reqs: Sequence[Req], grammars: GrammarBook) -> MaskJob | None:
        """Begins the step's staged copy with its grammar masks, filled on the fill thread (None: no grammar row);
        nothing else may touch `grammars`' matchers until `sample` joins it."""
        if not self._has_grammar(reqs):
            return None
        stage = self.h2d.stage()
        part, bits = stage.reserve((len(reqs), grammars.mask_words), torch.int32)
        if self._fill_thread is None:
            self._fill_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-masks")
        return MaskJob(stage, part, self._fill_thread.submit(_fill, grammars, list(reqs), bits))

    def sample(
        self,
        reqs: Sequence[Req],
        rows: Sequence[int],
        steps: Sequence[int],
        logits: torch.Tensor,
        grammars: GrammarBook,
        job: MaskJob | None = None,
    ) -> Sampled:
        """Samples one token per request of `reqs` (table `rows`, output `steps`) from `logits`; fills the grammar
        masks here unless `job` did."""
        batch = self._last
        if batch is not None and batch.reqs == tuple(reqs):
            new_batch = None
            any_grammar = batch.grammar
        else:
            new_batch = tuple(reqs)
            any_grammar = any(r.sampling.grammar is not None for r in reqs)
        stage, bits_part, masks = self._begin_stage(reqs, grammars, job, any_grammar)
        new_parts = self._stage_new_batch(reqs, rows, steps, stage) if new_batch is not None else None
        steps_part = stage.put(steps, torch.int64)
        params = [r.sampling for r in reqs] if new_batch is not None else None
        additions = (
            [i for i, p in enumerate(params) if p.logit_bias or p.min_tokens] if params is not None else batch.additions
        )
        add_key = add_parts = None
        if additions:
            last_key = None if batch is None or new_batch is not None else batch.add_key
            add_key, add_parts = self._stage_additions(
                reqs, steps, additions, masks, new_batch is not None, last_key, stage
            )
        grammar_part = None
        if masks is not None and self.device.type == "cuda":
            grammar_part = stage.put(masks.rows, torch.int32)  # xgrammar's GPU kernel reads its rows from here
        sent = stage.send()
        if new_batch is not None:
            assert params is not None and new_parts is not None
            batch = self._adopt_batch(new_batch, params, sent, new_parts, any_grammar, additions)
        assert batch is not None
        if additions:
            if add_parts is not None:
                batch.add_dev = (sent[add_parts[0]], sent[add_parts[1]], sent[add_parts[2]])
            elif new_batch is not None or add_key != batch.add_key:
                batch.add_dev = None  # nothing banned any more, no bias
            batch.add_key = add_key
        history = None
        if batch.penalty is not None:
            history = self.penalties.view(batch.penalty, steps, batch.flags.needs_penalty)
        steps_dev = sent[steps_part]
        sb = SamplingBatch.from_slots(
            batch.floats, batch.ints, steps_dev, batch.flags, history, *(batch.add_dev or (None, None, None))
        )
        if masks is not None:
            sb.allowed_bits = sent[bits_part] if bits_part is not None else None
            sb.grammar_rows = sent[grammar_part] if grammar_part is not None else masks.rows
            sb.grammar_vocab = grammars.mask_vocab
        result = sample(logits, sb)
        if batch.penalty is not None:
            self.penalties.record(batch.penalty, steps_dev, result.tokens)
        return Sampled(result, batch.rows_dev, masks.broken if masks is not None else [])

    def _begin_stage(
        self, reqs: Sequence[Req], grammars: GrammarBook, job: MaskJob | None, any_grammar: bool
    ) -> tuple[Stage, int | None, GrammarMasks | None]:
        """The step's staged copy and its grammar masks: `job`'s, or filled here when some row has a grammar."""
        if job is not None:
            return job.stage, job.part, job.masks.result()
        stage = self.h2d.stage()
        if not any_grammar:
            return stage, None, None
        # On a GPU the forward is still running: the masks are filled meanwhile, into the pinned buffer.
        bits_part, bits = stage.reserve((len(reqs), grammars.mask_words), torch.int32)
        return stage, bits_part, grammars.fill(reqs, bits)

    def _stage_new_batch(
        self, reqs: Sequence[Req], rows: Sequence[int], steps: Sequence[int], stage: Stage
    ) -> tuple[int, tuple[int, int, int] | None, PenaltyPlan | None]:
        """Stages a changed batch's table rows, the parameters of rows not yet written, and its penalty plan."""
        rows_part = stage.put(rows, torch.int64)
        fresh = [(i, row) for i, (r, row) in enumerate(zip(reqs, rows)) if not self._owned(r, row)]
        fresh_part = self._stage_params(reqs, fresh, stage) if fresh else None
        return rows_part, fresh_part, self.penalties.plan(reqs, rows, steps, stage)

    def _stage_additions(
        self,
        reqs: Sequence[Req],
        steps: Sequence[int],
        additions: list[int],
        masks: GrammarMasks | None,
        batch_is_new: bool,
        last_key: tuple[bool, ...] | None,
        stage: Stage,
    ) -> tuple[tuple[bool, ...], list[int] | None]:
        """Which addition rows ban end-of-sequence this step, and their logit additions staged when that changed."""
        done = masks.done if masks is not None else ()
        add_key = tuple(steps[i] < reqs[i].sampling.min_tokens and not (done and done[i]) for i in additions)
        if not batch_is_new and add_key == last_key:
            return add_key, None
        add = sparse_additions([r.sampling for r in reqs], steps, self.eos_ids, done, additions)
        return add_key, None if add is None else [stage.put(t, t.dtype) for t in add]

    def _adopt_batch(
        self,
        reqs: tuple[Req, ...],
        params: list[SamplingParams],
        sent: list[torch.Tensor],
        parts: tuple[int, tuple[int, int, int] | None, PenaltyPlan | None],
        any_grammar: bool,
        additions: list[int],
    ) -> _Batch:
        """Writes a changed batch's fresh parameters and gathers its rows; it is reused while the batch holds."""
        rows_part, fresh_part, plan = parts
        rows_dev = sent[rows_part]
        if fresh_part is not None:
            self._write_params(sent, fresh_part)
        batch = _Batch(
            reqs=reqs,
            rows_dev=rows_dev,
            floats=self.floats.index_select(0, rows_dev),
            ints=self.ints.index_select(0, rows_dev),
            flags=BatchFlags.of(params, self.vocab),
            penalty=None if plan is None else self.penalties.begin(plan, sent, rows_dev),
            grammar=any_grammar,
            additions=additions,
        )
        self._last = batch
        return batch

    def close(self) -> None:
        if self._fill_thread is not None:
            self._fill_thread.shutdown(wait=True)
            self._fill_thread = None

    def _owned(self, req: Req, row: int) -> bool:
        owner = self._owner[row]
        return owner is not None and owner() is req

    def _stage_params(self, reqs: Sequence[Req], fresh: list[tuple[int, int]], stage) -> tuple[int, int, int]:
        floats: list[float] = []
        ints: list[int] = []
        for i, row in fresh:
            f, n = slot_values(reqs[i].sampling, reqs[i].seed, self.vocab)
            floats += f
            ints += n
            self._owner[row] = weakref.ref(reqs[i])
        return (
            stage.put([row for _, row in fresh], torch.int64),
            stage.put(floats, torch.float32),
            stage.put(ints, torch.int64),
        )

    def _write_params(self, sent: list[torch.Tensor], parts: tuple[int, int, int]) -> None:
        rows_dev, floats, ints = (sent[p] for p in parts)
        self.floats.index_copy_(0, rows_dev, floats.view(-1, len(FLOAT_PARAMS)))
        self.ints.index_copy_(0, rows_dev, ints.view(-1, len(INT_PARAMS)))


@torch.inference_mode()
def _fill(grammars: GrammarBook, reqs: list[Req], bits: torch.Tensor) -> GrammarMasks:
    return grammars.fill(reqs, bits)  # inference mode is per thread: `bits` was made in it
