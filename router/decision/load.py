"""A worker's /load snapshot as the router reads it: the fields it uses, parsed leniently."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from common.capacity import StepCost

__all__ = ["ROLES", "Load", "parse_load"]

ROLES = ("prefill", "decode", "mixed")


@dataclass
class Load:
    """The fields of /load the router uses, parsed leniently: a missing one must not take the worker out."""

    role: str
    pod: str
    queued_prefill_tokens: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    free_pages: int = 0
    total_pages: int = 0
    page_size: int = 16
    ready: bool = False
    draining: bool = False
    max_running: int = 0  # 0: not reported (older workers)
    prefill_tokens_per_s: float = 0.0  # the worker's measured prefill rate (0: not measured yet)
    # prompt tokens one step takes beside decoding (0: not reported, or a prefill-first worker)
    prefill_chunk_tokens: int = 0
    prefill_step_tokens_per_s: float = 0.0  # device-timed prefill speed (0: not reported)
    decode_step_s: float = 0.0  # recent decode step time (0: not reported)
    itl_target_s: float = 0.0  # the ITL its steps beside decoding aim at (0: none, or not reported)
    live_requests: int | None = None  # requests the worker has open (engine or stream); None: not reported
    max_request_tokens: int = 0  # the most KV tokens one request may reserve there (0: not reported)
    kv_reserve_output_tokens: int = 0  # output tokens a request reserves there beyond its prompt (0: max_tokens)
    step_coefficients: dict[str, float] = field(default_factory=dict)
    step_chunk_tokens: int = 0
    decode_rows: int = 0
    decode_context: int = 0
    queued_ahead_tokens: dict[str, int] = field(default_factory=dict)
    step_overruns: int = 0  # steps beside decoding past the ITL target that their chunk caused (a counter)
    step_stalls: int = 0  # such gaps that were mostly host time (a counter)
    prompt_tokens_accepted: int = 0  # prompt tokens it accepted to prefill since it started (router/decision/peers.py)
    decodes_accepted: int = 0  # requests it accepted to decode since it started (the same, for the decode pick)

    @cached_property
    def step_cost(self) -> StepCost:
        """`step_coefficients` as the capacity model's value, built once per snapshot."""
        return StepCost.from_map(self.step_coefficients)


def parse_load(data: Any) -> Load:
    if not isinstance(data, dict) or not isinstance(data.get("pod"), str) or data.get("role") not in ROLES:
        raise ValueError("not a load snapshot")

    def num(key: str, default: int = 0) -> int:
        v = data.get(key, default)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    def rate(key: str) -> float:
        v = data.get(key, 0.0)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else 0.0

    return Load(
        role=data["role"],
        pod=data["pod"],
        queued_prefill_tokens=num("queued_prefill_tokens"),
        running_requests=num("running_requests"),
        waiting_requests=num("waiting_requests"),
        free_pages=num("free_pages"),
        total_pages=num("total_pages"),
        page_size=num("page_size", 16) or 16,
        ready=bool(data.get("ready", False)),
        draining=bool(data.get("draining", False)),
        max_running=num("max_running"),
        prefill_tokens_per_s=rate("prefill_tokens_per_s"),
        prefill_chunk_tokens=num("prefill_chunk_tokens"),
        prefill_step_tokens_per_s=rate("prefill_step_tokens_per_s"),
        decode_step_s=rate("decode_step_s"),
        itl_target_s=rate("itl_target_s"),
        live_requests=num("live_requests") if "live_requests" in data else None,
        max_request_tokens=num("max_request_tokens"),
        kv_reserve_output_tokens=num("kv_reserve_output_tokens"),
        step_coefficients=_numbers(data.get("step_coefficients"), float),
        step_chunk_tokens=num("step_chunk_tokens"),
        decode_rows=num("decode_rows"),
        decode_context=num("decode_context"),
        queued_ahead_tokens=_numbers(data.get("queued_ahead_tokens"), int),
        step_overruns=num("step_overruns"),
        step_stalls=num("step_stalls"),
        prompt_tokens_accepted=num("prompt_tokens_accepted"),
        decodes_accepted=num("decodes_accepted"),
    )


def _numbers(value: Any, kind: type[float] | type[int]) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {}
    return {
        k: kind(v)
        for k, v in value.items()
        if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
