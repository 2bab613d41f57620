"""One event of a decode worker's NDJSON generate stream, as the router reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class UpstreamEvent:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None  # TokenLogprob dicts: {"logprob", "top": [[id, lp], ...]}
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # With "error": only the worker was lost (its stream broke or stalled, or its engine exited), not the
    # request; router/migration.py continues it on another worker.
    retryable: bool = False
    timeline: dict[str, float] | None = None  # the first event's: the workers' stage stamps
    # With "error" before any token: the prefill worker was alive but too busy (overload, not a fault): the
    # router tries elsewhere and otherwise answers 429, never a 5xx.
    overloaded: bool = False

    @classmethod
    def parse(cls, line: str) -> UpstreamEvent:
        d = orjson.loads(line)
        return cls(
            token_ids=d.get("token_ids") or [],
            logprobs=d.get("logprobs"),
            finish_reason=d.get("finish_reason"),
            error=d.get("error"),
            prompt_tokens=d.get("prompt_tokens") or 0,
            cached_tokens=d.get("cached_tokens") or 0,
            retryable=bool(d.get("retryable")),
            timeline=d.get("timeline"),
            overloaded=bool(d.get("overloaded")),
        )


def lost_event(reason: str) -> UpstreamEvent:
    """The event a call ends with when only its worker was lost (router/migration.py continues the choice)."""
    return UpstreamEvent(finish_reason="error", error=reason, retryable=True)
