"""One request's trace on a worker's control plane: its span (when tracing is on) and its stage stamps.

A worker request starts a span named after the call (``decode generate``, ``prefill``), child of the
caller's W3C ``traceparent`` header; the engine's stamps (common/observability/timeline.py) become its
child spans when the request ends, with their real times. With tracing off the span is None and only the
stamps (which the timeline needs anyway) are kept.
"""

from __future__ import annotations

import time
from typing import Any

from common.observability import tracing
from common.observability.timeline import Stamps, spans_between

__all__ = ["DECODE_SPANS", "PREFILL_SPANS", "WorkerTrace"]

# (span name, from stage, to stage): what a worker's span is made of.
DECODE_SPANS = (
    ("engine queue", "decode_engine_received", "decode_admitted"),
    ("wait for KV pages", "decode_engine_received", "pages_reserved"),
    ("remote prefill and KV transfer", "prefill_requested", "kv_landed"),
    ("local prefill", "decode_admitted", "first_token"),
    ("first token", "first_token", "first_token_sent"),
    ("decode", "first_token_sent", "stream_end"),
)
PREFILL_SPANS = (
    ("engine queue", "prefill_engine_received", "prefill_admitted"),
    ("prefill compute", "prefill_admitted", "prefill_first_token"),
)


class WorkerTrace:
    def __init__(self, name: str, req_id: str, parent: str | None, attributes: dict[str, Any] | None = None) -> None:
        self.received = time.time()
        self.stamps: Stamps = {}
        self.extra: list[tuple[str, float, float]] = []  # child spans timed elsewhere: (name, start, end)
        self.span = tracing.start_span(name, parent, self.received, {"kvferry.req_id": req_id, **(attributes or {})})

    def headers(self) -> dict[str, str]:
        """For an internal call made on this request's behalf: the traceparent naming this span."""
        tp = tracing.traceparent(self.span)
        return {"traceparent": tp} if tp else {}

    def mark(self, stage: str) -> None:
        self.stamps[stage] = time.time()

    def end(self, pairs: tuple[tuple[str, str, str], ...], error: str | None = None) -> None:
        """Ends the span: children from the stamps (``pairs``: name, from stage, to stage) and ``extra``."""
        if self.span is None:
            return
        end = time.time()
        stamps = {**self.stamps, "stream_end": end}
        tracing.child_spans(self.span, [*spans_between(stamps, pairs), *self.extra])
        tracing.end_span(self.span, end, error=error)
