from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from common.protocol import PromptLogprobs, SamplingParams, TokenLogprob


class ReqState(enum.Enum):
    COMPILING = "compiling"  # its grammar compiles on a worker thread; queued for prefill once compiled
    WAITING = "waiting"  # queued for prefill
    PREFILLING = "prefilling"  # admitted, prompt partly computed (chunked)
    AWAITING_KV = "awaiting_kv"  # decode side: pages reserved for its KV connector, a prefill peer writes them
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass(frozen=True)
class ParkedKV:
    """A preempted request's KV in the host tier: its first `tokens` tokens, in `host_pages` (in order)."""

    host_pages: torch.Tensor  # int64 host-tier page ids, owned by the request until resumed or ended
    tokens: int


@dataclass(eq=False)
class Req:
    """The ledger of one request: `cached_len <= device_len <= max_device_len` (KV in the pool, tokens known, the
    most it may hold), moved only by the scheduler, at launch."""

    req_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int = field(default_factory=lambda: random.getrandbits(62))
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # The prompt's logprobs, filled chunk by chunk (or from the prefill peer's notice); None: not asked for.
    prompt_logprobs: PromptLogprobs | None = None
    cached_len: int = 0
    device_len: int = 0
    max_device_len: int = 0
    prefix_hit_len: int = 0  # prompt tokens found in the prefix cache at admission (reported as cached)
    table_row: int = -1
    pages: list[int] = field(default_factory=list)  # page ids covering positions [0, len(pages)*page_size)
    tree_pages: int = 0  # leading entries of `pages` owned by the radix cache (locked through cache_node)
    cache_node: Any = None
    block_hashes: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    finish_reason: str | None = None
    error: str | None = None
    request_fault: bool = False  # the error is the request's own (a grammar no token can follow): a 400, no retry
    stream_cursor: int = 0  # outputs already handed to the caller
    # Prefilled for a peer: once its first token is sampled it never joins the decode batch.
    prefill_only: bool = False
    # Its SLO class's rank, set when the scheduler takes it (queue order, ITL target of its steps).
    slo_rank: int = 0
    itl_target_s: float = 0.0
    deadline_s: float = 0.0  # monotonic time its first token is due (the waiting queue's order)
    # Tokens whose pages it reserved when admitted (the memory policy).
    reserve_len: int = 0
    # Preemption: its KV parked in the host tier while it waits (None: recomputed on readmission), and the
    # tokens whose KV it had when last preempted (a prefill below that is a recompute, counted).
    parked: ParkedKV | None = None
    preempted_kv_len: int = 0

    def __post_init__(self) -> None:
        if self.sampling.seed is not None:
            self.seed = self.sampling.seed
        self.device_len = len(self.prompt_ids)
        self.max_device_len = len(self.prompt_ids) + self.sampling.max_tokens
        if self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = PromptLogprobs()
        self.check()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def scores_prompt(self) -> bool:
        """Its prefill computes the prompt's logprobs (asked for, and no token out yet: a recompute after a
        preemption has them already)."""
        return self.sampling.prompt_logprobs is not None and not self.output_ids

    @property
    def cache_match_limit(self) -> int:
        """The longest prefix cache hit it may take: all but the last token (one must be computed for logits), or
        none when its prompt is scored (cached positions were never run through the model for it)."""
        return 0 if self.scores_prompt else self.device_len - 1

    @property
    def prefill_done(self) -> bool:
        return self.cached_len >= self.prompt_len

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    def check(self) -> None:
        assert 0 <= self.cached_len <= self.device_len <= self.max_device_len, (
            f"{self.req_id}: lengths out of order: cached={self.cached_len} device={self.device_len} "
            f"max={self.max_device_len}"
        )

    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def fill_ids(self) -> list[int]:
        """The tokens a prefill computes: its prompt, plus its outputs after a preemption (recomputed)."""
        return self.prompt_ids if not self.output_ids else self.prompt_ids + self.output_ids
