"""Router-only knobs that common/config.py's RouterConfig does not carry.

Each is declared in common/settings_registry.py (``KVFERRY_ROUTER_<NAME>``, its default and docs) and is also
the ``kvferry router`` flag ``--<name>`` (router/main.py). Defaults suit a small CPU cluster and a GPU fleet alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from common import settings_registry as reg

__all__ = ["RouterOptions"]


@dataclass
class RouterOptions(reg.EnvFields):
    tokenizer: str = reg.ROUTER_TOKENIZER.field()
    # Per-process pools, polls and admission by design: the workers' own load figures are the shared truth.
    workers: int = reg.ROUTER_WORKERS.field()
    event_loop: str = reg.ROUTER_EVENT_LOOP.field()
    http: str = reg.ROUTER_HTTP.field()
    # Admission and limits (the HTTP limits, body size included, are common/settings.py HttpLimits).
    max_inflight: int = reg.ROUTER_MAX_INFLIGHT.field()
    retry_after_s: int = reg.ROUTER_RETRY_AFTER_S.field()
    default_max_tokens: int = reg.ROUTER_DEFAULT_MAX_TOKENS.field()
    # Routing (router/decision/policy.py documents how these enter the scores).
    routing: str = reg.ROUTER_ROUTING.field()
    disagg_min_prompt_tokens: int = reg.ROUTER_DISAGG_MIN_PROMPT_TOKENS.field()
    local_prefix_fraction: float = reg.ROUTER_LOCAL_PREFIX_FRACTION.field()
    prefill_load_weight: float = reg.ROUTER_PREFILL_LOAD_WEIGHT.field()
    imbalance_abs_tokens: int = reg.ROUTER_IMBALANCE_ABS_TOKENS.field()
    imbalance_ratio: float = reg.ROUTER_IMBALANCE_RATIO.field()
    decode_kv_weight: float = reg.ROUTER_DECODE_KV_WEIGHT.field()
    recent_route_ttl_s: float = reg.ROUTER_RECENT_ROUTE_TTL_S.field()
    sample_workers: int = reg.ROUTER_SAMPLE_WORKERS.field()
    # Placement (router/decision/cost_model.py).
    placement: str = reg.ROUTER_PLACEMENT.field()
    transfer_tokens_per_s: float = reg.ROUTER_TRANSFER_TOKENS_PER_S.field()
    # Admission per worker (router/decision/admission.py; 0 turns a check off): beyond these, 429 + Retry-After.
    admit_max_waiting: int = reg.ROUTER_ADMIT_MAX_WAITING.field()
    admit_max_queued_prefill_tokens: int = reg.ROUTER_ADMIT_MAX_QUEUED_PREFILL_TOKENS.field()
    admit_queue_seconds: float = reg.ROUTER_ADMIT_QUEUE_SECONDS.field()
    admit_by_ttft: int = reg.ROUTER_ADMIT_BY_TTFT.field()
    ttft_error_quantile: float = reg.ROUTER_TTFT_ERROR_QUANTILE.field()
    # Worker health (router/decision/pool.py): a slow poll only makes a worker stale; down needs proof or silence.
    poll_interval_s: float = reg.ROUTER_POLL_INTERVAL_S.field()
    poll_timeout_s: float = reg.ROUTER_POLL_TIMEOUT_S.field()
    down_after_failures: int = reg.ROUTER_DOWN_AFTER_FAILURES.field()
    down_after_s: float = reg.ROUTER_DOWN_AFTER_S.field()
    # Upstream deadlines.
    connect_timeout_s: float = reg.ROUTER_CONNECT_TIMEOUT_S.field()
    first_token_timeout_s: float = reg.ROUTER_FIRST_TOKEN_TIMEOUT_S.field()
    inter_token_timeout_s: float = reg.ROUTER_INTER_TOKEN_TIMEOUT_S.field()
    stall_exit_s: float = reg.ROUTER_STALL_EXIT_S.field()  # common/loop_watchdog.py
    redis_timeout_s: float = reg.ROUTER_REDIS_TIMEOUT_S.field()
    # A stream whose decode worker is lost continues on another one (router/upstream/migration.py).
    migration_limit: int = reg.ROUTER_MIGRATION_LIMIT.field()
    migration_wait_s: float = reg.ROUTER_MIGRATION_WAIT_S.field()
