"""Penalty state on the device: each table row's token history and its output-token counts.

`ids` [rows, capacity] holds each row's history (prompt, then output), padded past its end with its first id, so
any window is its ids padded by repetition; `counts` [rows, V] its output counts. A row is filled at its
request's first sampling and then appended and counted on the device by each step that samples it, so a step's
penalties never wait for the host and no history travels per step. Whoever takes a row next refills it before
reading it. The tensors are built at the first request asking for a penalty.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.engine.sampling import PenaltyView
from common.engine.staging import Stage
from common.protocol import SamplingParams
from common.sched.request import Req

MIN_CAPACITY = 256  # history columns first allocated; doubled when a batch's window outgrows them


def has_penalty(p: SamplingParams) -> bool:
    return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)


@dataclass
class PenaltyPlan:
    start: int  # per batch row: where its output step 0 goes in its history (negative: no penalty)
    fill: list[int] | None  # fresh rows, their first ids, and (row, column, id) of each history token
    outputs: int  # how many of those history tokens (the first ones) are output, to be counted
    width: int  # the window at the batch's first sampling: its longest history
    step: int  # output step of the batch's first row at that sampling


@dataclass
class PenaltyBatch:
    rows_dev: torch.Tensor  # [B] int64 table rows
    start: torch.Tensor  # [B] int64, as `PenaltyPlan.start`
    count_index: torch.Tensor  # [B] int64: each row's offset in the flat counts
    ones: torch.Tensor  # [B] float32: one count per sampled token
    width: int
    step: int


class PenaltyHistory:
    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.rows = rows
        self.vocab = vocab
        self.device = device
        self.ids: torch.Tensor | None = None  # [rows, capacity] int64: history, then the first id repeated
        self.counts: torch.Tensor | None = None  # [rows, V] float32: output tokens, per table row
        self._owner: list[weakref.ref[Req] | None] = [None] * rows

    def _owned(self, req: Req, row: int) -> bool:
        owner = self._owner[row]
        return owner is not None and owner() is req

    def _reserve(self, width: int) -> None:
        """At least `width` history columns (a copy into a wider tensor, padded with each row's first id)."""
        if self.ids is None:
            self.ids = torch.zeros(self.rows, max(MIN_CAPACITY, width), dtype=torch.int64, device=self.device)
            self.counts = torch.zeros(self.rows, self.vocab, dtype=torch.float32, device=self.device)
        old = self.ids.shape[1]
        if width > old:
            capacity = max(width, 2 * old)
            wider = torch.empty(self.rows, capacity, dtype=torch.int64, device=self.device)
            wider[:, :old] = self.ids
            wider[:, old:] = self.ids[:, :1]
            self.ids = wider

    def plan(self, reqs: Sequence[Req], rows: Sequence[int], steps: Sequence[int], stage: Stage) -> PenaltyPlan | None:
        """Host half of a new batch's penalties (None: no row has one): token slots, fresh rows' history, window."""
        if not any(has_penalty(r.sampling) for r in reqs):
            return None
        starts: list[int] = []
        width = 0
        fresh: list[tuple[Req, int]] = []
        for r, row, step in zip(reqs, rows, steps):
            if has_penalty(r.sampling):
                cut = r.prompt_len - r.sampling.output_offset
                starts.append(cut)
                width = max(width, cut + step)
                if not self._owned(r, row):
                    fresh.append((r, row))
            else:
                starts.append(-step)  # its own tokens from 0 on, inside the window: read, never weighed
        self._reserve(width + 1)  # + this step's token
        fill = None
        outputs = 0
        if fresh:
            out_rows: list[int] = []
            out_cols: list[int] = []
            out_ids: list[int] = []
            prompt_rows: list[int] = []
            prompt_cols: list[int] = []
            prompt_ids: list[int] = []
            for r, row in fresh:
                cut = r.prompt_len - r.sampling.output_offset
                earlier = r.prompt_ids[cut:] + r.output_ids
                out_rows += [row] * len(earlier)
                out_cols += range(cut, cut + len(earlier))
                out_ids += earlier
                prompt_rows += [row] * cut
                prompt_cols += range(cut)
                prompt_ids += r.prompt_ids[:cut]
                self._owner[row] = weakref.ref(r)
            outputs = len(out_ids)
            parts = [
                [row for _, row in fresh],
                [r.prompt_ids[0] for r, _ in fresh],
                out_rows + prompt_rows,
                out_cols + prompt_cols,
                out_ids + prompt_ids,
            ]
            fill = [stage.put(part, torch.int64) for part in parts]
        return PenaltyPlan(stage.put(starts, torch.int64), fill, outputs, width, steps[0])

    def begin(self, plan: PenaltyPlan, sent: list[torch.Tensor], rows_dev: torch.Tensor) -> PenaltyBatch:
        """Device half: fills the fresh rows, keeps the batch's state."""
        assert self.ids is not None and self.counts is not None
        if plan.fill is not None:
            fresh, first, rows, cols, ids = (sent[i] for i in plan.fill)
            self.ids.index_put_((fresh,), first[:, None])  # the whole row, then its history over it
            self.ids.index_put_((rows, cols), ids)
            self.counts.index_fill_(0, fresh, 0.0)
            out = slice(0, plan.outputs)
            # A scatter-add on the flat view: an output repeats tokens, each occurrence counts.
            ones = torch.ones(plan.outputs, dtype=torch.float32, device=self.device)
            self.counts.view(-1).scatter_add_(0, rows[out] * self.vocab + ids[out], ones)
        return PenaltyBatch(
            rows_dev=rows_dev,
            start=sent[plan.start],
            count_index=rows_dev * self.vocab,
            ones=torch.ones(rows_dev.shape, dtype=torch.float32, device=self.device),
            width=plan.width,
            step=plan.step,
        )

    def view(self, batch: PenaltyBatch, steps: Sequence[int], counted: bool) -> PenaltyView:
        width = batch.width + steps[0] - batch.step
        self._reserve(width + 1)
        assert self.ids is not None and self.counts is not None
        return PenaltyView(self.ids, self.counts if counted else None, batch.rows_dev, width)

    def record(self, batch: PenaltyBatch, steps_dev: torch.Tensor, tokens: torch.Tensor) -> None:
        """Appends and counts a step's sampled tokens on the device, right after sampling them."""
        assert self.ids is not None and self.counts is not None
        if tokens.is_cuda:
            from common.engine.gpu.penalty import record  # Triton: imported only on a GPU

            record(self.ids, self.counts, batch.rows_dev, batch.start, steps_dev, tokens)
            return
        self.ids.index_put_((batch.rows_dev, batch.start + steps_dev), tokens)
        # A batch's rows are distinct, so are its (row, token) pairs: an index-add on the flat view.
        self.counts.view(-1).index_add_(0, batch.count_index + tokens, batch.ones)
