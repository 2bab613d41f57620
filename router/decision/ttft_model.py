"""A new request's time to first token on one worker, predicted from that worker's /load: one pure function.
For class c with ``own`` uncached prompt tokens (``ahead_c`` queued ahead, ``unseen`` placed by this router
since the snapshot):

    work   = ahead_c + unseen + own;  steps = ceil(work / chunk)
    ttft   = steps * (base + per_row * rows + per_context * context) + per_prefill_token * work
           + per_attention_pair * (own^2 / 2 + ahead * min(chunk, ahead) / 2) + transfer

The attention term is exact for the request's own prompt and a lower bound for those ahead (their lengths are
not published). Without coefficients: ``work / prefill_tokens_per_s``; with neither, None (never shed on a guess).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.capacity import StepCost

if TYPE_CHECKING:
    from router.decision.load import Load

__all__ = ["StepCost", "WorkerFigures", "predict_ttft_s", "prefill_rate"]


@dataclass(slots=True)  # built per load snapshot and placement: a frozen one's __init__ costs ~3x
class WorkerFigures:
    """One worker's TTFT inputs from its last /load (plus this router's unseen placements)."""

    chunk_tokens: int = 0  # prompt tokens the next step takes (0: not reported)
    decode_rows: int = 0
    decode_context: int = 0
    cost: StepCost = field(default_factory=StepCost)
    ahead_tokens: Mapping[str, int] = field(default_factory=dict)  # per SLO class
    queued_tokens: int = 0  # all prompt tokens queued (a class the worker did not report waits behind all)
    rate_tokens_per_s: float = 0.0  # measured prefill rate: the fallback without a step model
    unseen_tokens: int = 0
    step_overhead_s: float = field(init=False)  # each step's cost beside its chunk (the base and the decode batch)
    stepped: bool = field(init=False)  # predicted step by step (a step model and a chunk), not by the rate alone

    def __post_init__(self) -> None:
        self.step_overhead_s = self.cost.overhead_s(self.decode_rows, self.decode_context)
        self.stepped = self.cost.known and self.chunk_tokens > 0

    @classmethod
    def from_load(cls, load: Load, unseen_tokens: int = 0) -> WorkerFigures:
        # positional: built per snapshot and placement, a few times a request, where keywords cost ~2x
        return cls(
            load.step_chunk_tokens,  # chunk_tokens
            load.decode_rows,  # decode_rows
            load.decode_context,  # decode_context
            load.step_cost,  # cost
            load.queued_ahead_tokens,  # ahead_tokens
            load.queued_prefill_tokens,  # queued_tokens
            load.prefill_tokens_per_s,  # rate_tokens_per_s
            unseen_tokens,  # unseen_tokens
        )

    def ahead(self, slo_class: str) -> int:
        return self.ahead_tokens.get(slo_class, self.queued_tokens) + self.unseen_tokens


def prefill_rate(w: WorkerFigures) -> float:
    """Prompt tokens per second at the worker's chunk beside its decode batch (0: unknown)."""
    if w.stepped:
        return w.cost.prefill_rate(w.chunk_tokens, w.decode_rows, w.decode_context)
    return w.rate_tokens_per_s


def predict_ttft_s(
    w: WorkerFigures, slo_class: str, own_tokens: int, transfer_s: float = 0.0, queued: bool = True
) -> float | None:
    """Predicted seconds until a request of `slo_class` with `own_tokens` uncached tokens has its first token on
    `w`; None: nothing measured. `queued` False: as if nothing waited ahead."""
    ahead = w.ahead(slo_class) if queued else 0
    own = max(own_tokens, 1)  # a full prefix hit still runs one step for its first token
    work = ahead + own
    if w.stepped:
        c, cost = w.chunk_tokens, w.cost
        steps = math.ceil(work / c)
        pairs = own * own / 2 + ahead * min(c, ahead) / 2
        compute = steps * w.step_overhead_s + cost.per_prefill_token_s * work
        return compute + cost.per_attention_pair_s * pairs + transfer_s
    if w.rate_tokens_per_s > 0:
        return work / w.rate_tokens_per_s + transfer_s
    return None
