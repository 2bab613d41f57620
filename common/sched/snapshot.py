"""What a scheduler shows the code that serves it, in one value: the worker's load, its page ledger in
numbers and the step policy it publishes for the router's cost model (router/decision/cost_model.py).

The serving side reads a `SchedulerSnapshot` (`Scheduler.snapshot()`, built on demand: a worker builds one per
load report, ten a second) and never the scheduler's fields, so the scheduler's bookkeeping can change without
touching it. What a worker reads every step is a method of its own (`Scheduler.last_step_kind`), so the step
loop never pays for a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    running: int  # requests holding a batch slot: decoding, awaiting their KV, or partway through their prompt
    waiting: int  # queued for prefill
    held: int  # finished requests whose pages a KV connector still holds (a transfer reads or writes them)
    queued_prefill_tokens: int  # prompt tokens not computed yet, waiting or chunked
    prefill_tokens_launched: int  # prompt tokens computed so far (a counter: the measured prefill rate's input)
    free_pages: int  # pages an admission may still take: free or evictable, less those promised to requests
    total_pages: int
    # The step policy (common/sched/prefill_budget.py): the chunk a step takes beside decoding requests (0:
    # mixed steps off), the ITL those steps aim at, and the device-timed prefill speed a chunk adds at.
    prefill_chunk_tokens: int
    itl_target_s: float
    prefill_step_tokens_per_s: float
    # What predicts a new request's TTFT (router/decision/ttft_model.py): the step-time model's seconds per unit of each
    # feature (common/sched/step_model.py; empty until it has timed prompt chunks), the prompt chunk the next
    # step takes as the batch stands (beside decoding, or alone), the decode rows and KV context such a step
    # carries (0 with prefill-first steps: they decode nothing), and per SLO class the prompt tokens queued
    # ahead of a request of that class arriving now (the waiting queue's deadline order, plus the chunked one).
    step_coefficients: dict[str, float] = field(default_factory=dict)
    step_chunk_tokens: int = 0
    decode_rows: int = 0
    decode_context: int = 0
    queued_ahead_tokens: dict[str, int] = field(default_factory=dict)
    # The prefix cache's host tier (all 0 without one).
    host_pages_cached: int = 0
    host_pages_total: int = 0
    host_pages_saved: int = 0
    host_pages_loaded: int = 0
    # Output tokens an admitted request reserves beyond its prompt (optimistic reservation, common/sched/pages.py);
    # 0: all of its max_tokens (full reservation).
    kv_reserve_output_tokens: int = 0
