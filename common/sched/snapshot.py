"""What a scheduler shows the code that serves it, in one value built on demand (ten a second): load, page
ledger and the published step policy. The serving side never reads the scheduler's fields.
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
    # The step policy: the chunk beside decoding (0: mixed steps off), its ITL aim, the timed prefill speed.
    prefill_chunk_tokens: int
    itl_target_s: float
    prefill_step_tokens_per_s: float
    # TTFT inputs (router/decision/ttft_model.py): the step-time model's coefficients, the next chunk, the decode
    # rows and context beside it, and per SLO class the prompt tokens queued ahead of an arrival now.
    step_coefficients: dict[str, float] = field(default_factory=dict)
    step_chunk_tokens: int = 0
    decode_rows: int = 0
    decode_context: int = 0
    queued_ahead_tokens: dict[str, int] = field(default_factory=dict)
    host_pages_cached: int = 0
    host_pages_total: int = 0
    host_pages_locked: int = 0  # page-locked so far (the tier is used once all are; on the CPU all at once)
    host_pages_saved: int = 0
    host_pages_loaded: int = 0
    # Output tokens a request reserves beyond its prompt (optimistic reservation); 0: all of max_tokens.
    kv_reserve_output_tokens: int = 0
    # Preemptions since start (optimistic reservation): all, those parked in the host tier, and the tokens
    # prefilled again that had KV before one (counters).
    preemptions: int = 0
    preemptions_parked: int = 0
    recomputed_tokens: int = 0
    # Steps beside decoding past the ITL target (counters): those the chunk caused (each trims the budget,
    # common/sched/itl_trim.py) and gaps that were mostly host time (stalls no chunk size would avoid).
    step_overruns: int = 0
    step_stalls: int = 0
