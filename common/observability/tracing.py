"""OpenTelemetry spans for the request path, off (no import, no span, no header) unless an OTLP endpoint is set.
Context crosses processes as W3C ``traceparent`` on internal calls; the stages inside a live span are timeline
stamps turned into child spans when the request ends, so the hot path only takes timestamps.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("kvferry.tracing")

__all__ = [
    "ENDPOINT_VARS",
    "child_spans",
    "end_span",
    "init_tracing",
    "start_span",
    "trace_id",
    "traceparent",
    "tracing_enabled",
]

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

_tracer: Any = None  # an opentelemetry Tracer once init_tracing found an endpoint


def tracing_enabled() -> bool:
    return _tracer is not None


def init_tracing(service: str, environ: dict[str, str] | None = None) -> bool:
    """Turns tracing on when an OTLP endpoint is set; True when on. Idempotent."""
    global _tracer
    env = os.environ if environ is None else environ
    if _tracer is not None or not any(env.get(v) for v in ENDPOINT_VARS):
        return _tracer is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    # Our own provider, not the global one: libraries tracing through it (FastAPI's per-request spans) stay off.
    _tracer = provider.get_tracer("kvferry")
    log.info("tracing on", extra={"service": service})
    return True


def _ns(t: float | None) -> int | None:
    return None if t is None else int(t * 1e9)


def start_span(
    name: str,
    parent_traceparent: str | None = None,
    start: float | None = None,
    attributes: dict[str, Any] | None = None,
) -> Any:
    """A live span (None when off), child of ``parent_traceparent``'s context if any; ``start``: wall-clock seconds."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({"traceparent": parent_traceparent}) if parent_traceparent else None
    return _tracer.start_span(name, context=ctx, start_time=_ns(start), attributes=attributes)


def traceparent(span: Any) -> str | None:
    if span is None:
        return None
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def trace_id(span: Any) -> str | None:
    return None if span is None else f"{span.get_span_context().trace_id:032x}"


def child_spans(parent: Any, spans: list[tuple[str, float, float]], attributes: dict[str, Any] | None = None) -> None:
    if parent is None or _tracer is None:
        return
    from opentelemetry import trace

    ctx = trace.set_span_in_context(parent)
    for name, t0, t1 in spans:
        child = _tracer.start_span(name, context=ctx, start_time=_ns(t0), attributes=attributes)
        child.end(end_time=_ns(max(t0, t1)))


def end_span(
    span: Any, end: float | None = None, attributes: dict[str, Any] | None = None, error: str | None = None
) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=_ns(end))
