"""Router-only knobs that common/config.py's RouterConfig does not carry.

Each one can be set by a ``KVFERRY_ROUTER_*`` env var (read in ``RouterOptions.from_env``) or the
matching ``kvferry router`` flag (router/main.py). Defaults suit a small CPU cluster and a GPU fleet alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

__all__ = ["RouterOptions"]

_ENV_PREFIX = "KVFERRY_ROUTER_"


@dataclass
class RouterOptions:
    tokenizer: str = ""  # tokenizer directory when the model id is not one (e.g. dummy:<config> workers)
    # Router processes in this pod, sharing its port (one per core streams more tokens/s: bench/RESULTS.md).
    # Each has its own worker pool, polls, in-flight counts and admission (per-process by design: the
    # workers' own load figures are the shared truth); the prefix index they share lives in Redis.
    workers: int = 1
    event_loop: str = "auto"  # uvicorn's event loop: auto (uvloop when installed) | uvloop | asyncio
    http: str = "auto"  # uvicorn's HTTP parser: auto (httptools when installed) | httptools | h11
    # Admission and limits (the HTTP limits, body size included, are common/settings.py HttpLimits).
    max_inflight: int = 4096  # requests in this router process at once; beyond it: 429 + Retry-After
    retry_after_s: int = 1
    default_max_tokens: int = 1024  # chat without max_tokens: min(this, what fits the context)
    # Routing (router/policy.py documents how these enter the scores).
    routing: str = "cache_aware"  # cache_aware | round_robin (baseline)
    disagg_min_prompt_tokens: int = 256  # shorter prompts are prefilled on the decode pod
    local_prefix_fraction: float = 0.8  # a decode pod holding this much of the prompt prefills it
    prefill_load_weight: float = 0.5
    imbalance_abs_tokens: int = 2048
    imbalance_ratio: float = 1.5
    decode_kv_weight: float = 4.0
    recent_route_ttl_s: float = 10.0  # how long the router's own placements count as cached
    # Placement (router/cost_model.py): adaptive picks local vs. disaggregated per request from predicted
    # TTFT and ITL against these targets and the workers' measured rates; fixed uses the two thresholds above.
    placement: str = "fixed"  # fixed | adaptive
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.025
    transfer_tokens_per_s: float = 200_000.0  # KV transfer rate assumed until workers publish one
    # Admission per worker (router/admission.py; 0 turns a check off): beyond these, 429 + Retry-After.
    admit_max_waiting: int = 64  # decode worker: waiting requests + those sent since its last snapshot
    admit_max_queued_prefill_tokens: int = 32768  # any worker: prompt tokens queued for prefill (a floor ...)
    admit_queue_seconds: float = 2.0  # ... raised to what the worker prefills in this long (its measured rate)
    # Worker health (router/pool.py): a slow poll only makes a worker stale; down needs proof or silence.
    poll_interval_s: float = 0.25  # also how fresh the load that admission and routing read is
    poll_timeout_s: float = 2.0
    down_after_failures: int = 3  # polls failed in a row ...
    down_after_s: float = 5.0  # ... and nothing heard from the worker (polls, stream events) for this long
    # Upstream deadlines.
    connect_timeout_s: float = 3.0
    first_token_timeout_s: float = 300.0
    inter_token_timeout_s: float = 120.0
    redis_timeout_s: float = 0.2
    # A stream whose decode worker is lost continues on another one (router/migration.py), at most this many
    # times per choice; a continuation waits this long for a decode worker to be ready (they may be restarting).
    migration_limit: int = 3
    migration_wait_s: float = 30.0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RouterOptions:
        env = os.environ if environ is None else environ
        opts = cls()
        for f in fields(cls):
            raw = env.get(_ENV_PREFIX + f.name.upper())
            if raw:
                setattr(opts, f.name, type(getattr(opts, f.name))(raw))
        return opts
