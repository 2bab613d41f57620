"""Penalty state on the device: each table row's output-token counts and the tokens of its prompt.

Frequency and presence penalties read how often each token occurs in a request's output; the repetition
penalty reads which tokens occur in its prompt or output. Both live here as [rows, vocab] tensors indexed by
table row, on the scheduler's device: a request's row is filled once, at its first sampling (its earlier
output, the prompt's last `output_offset` tokens of a continued request, counts as output), and every
sampled token is added on the device by the step that sampled it. So a step's penalties never wait for the
host to learn the previous step's tokens, and no history travels to the device per step.

A row is owned by the request that filled it: a request that later takes the row (any request, a finished
one's token from a step still in flight included) fills it again before it reads it; rows of requests without
penalties are read too (the batch is gathered whole) but weighed by zero penalties. The tensors are built at
the first request that asks for them; a worker that never sees a penalty holds neither.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.engine.staging import Stage
from common.protocol import SamplingParams
from common.sched.request import Req


def has_penalty(p: SamplingParams) -> bool:
    return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)


class PenaltyCounts:
    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.rows = rows
        self.vocab = vocab
        self.device = device
        self.counts: torch.Tensor | None = None  # [rows, V] float32: output tokens, per table row
        self.in_prompt: torch.Tensor | None = None  # [rows, V] bool: prompt tokens (repetition penalty only)
        self._owner: list[weakref.ref[Req] | None] = [None] * rows

    def _owned(self, req: Req, row: int) -> bool:
        owner = self._owner[row]
        return owner is not None and owner() is req

    def stage_fill(self, reqs: Sequence[Req], rows: Sequence[int], stage: Stage) -> PendingFill | None:
        """Host half of a batch's first sampling of its penalty rows (call when the batch is not the one
        sampled last): the rows of requests sampling here for the first time, and their token ids, into the
        step's staged copy, to be counted on the device (`apply_fill`; no [rows, V] tensor on the host).
        Builds the tensors at the first request that needs them. None: nothing to fill."""
        if not any(has_penalty(r.sampling) for r in reqs):
            return None
        if self.counts is None:
            self.counts = torch.zeros(self.rows, self.vocab, dtype=torch.float32, device=self.device)
        if self.in_prompt is None and any(r.sampling.repetition_penalty != 1.0 for r in reqs):
            self.in_prompt = torch.zeros(self.rows, self.vocab, dtype=torch.bool, device=self.device)
        fresh = [(r, row) for r, row in zip(reqs, rows) if has_penalty(r.sampling) and not self._owned(r, row)]
        if not fresh:
            return None
        out_rows: list[int] = []
        out_ids: list[int] = []
        prompt_rows: list[int] = []
        prompt_ids: list[int] = []
        for r, row in fresh:
            cut = r.prompt_len - r.sampling.output_offset
            earlier = r.prompt_ids[cut:] + r.output_ids
            out_rows += [row] * len(earlier)
            out_ids += earlier
            if r.sampling.repetition_penalty != 1.0:
                prompt_rows += [row] * cut
                prompt_ids += r.prompt_ids[:cut]
            self._owner[row] = weakref.ref(r)
        parts = [[row for _, row in fresh], out_rows, out_ids, prompt_rows, prompt_ids]
        return PendingFill([stage.put(part, torch.int64) for part in parts])

    def apply_fill(self, fill: PendingFill, sent: list[torch.Tensor]) -> None:
        """Device half: writes the staged rows (`sent`: the stage's device tensors)."""
        assert self.counts is not None
        rows_dev, out_rows, out_ids, prompt_rows, prompt_ids = (sent[i] for i in fill.parts)
        # Scatters on flat views: prompts repeat tokens, each occurrence counts.
        self.counts.index_fill_(0, rows_dev, 0.0)
        ones = torch.ones(out_ids.shape, dtype=torch.float32, device=self.device)
        self.counts.view(-1).scatter_add_(0, out_rows * self.vocab + out_ids, ones)
        if prompt_ids.numel():
            assert self.in_prompt is not None
            self.in_prompt.index_fill_(0, rows_dev, False)
            self.in_prompt.view(-1).scatter_(0, prompt_rows * self.vocab + prompt_ids, True)

    def gather(self, rows_dev: torch.Tensor, repetition: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output counts [B, V], seen [B, V] with `repetition`, else None) of a batch's rows, in batch order."""
        assert self.counts is not None
        counts = self.counts.index_select(0, rows_dev)
        seen = None
        if repetition:
            assert self.in_prompt is not None
            seen = self.in_prompt.index_select(0, rows_dev) | (counts > 0)
        return counts, seen

    def record(self, rows_dev: torch.Tensor, tokens: torch.Tensor) -> None:
        """Counts a step's sampled tokens (on the device, right after sampling them)."""
        if self.counts is not None:
            # index_put_ (8B on the H200: 0.93 of no penalties) rather than a flat scatter-add (0.63 in a later
            # run with the same baseline; bench/RESULTS.md).
            ones = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
            self.counts.index_put_((rows_dev, tokens), ones, accumulate=True)


@dataclass
class PendingFill:
    parts: list[int]  # indices in the stage: rows, output (row, id) pairs, prompt (row, id) pairs
