"""OpenTelemetry spans for the request path, off unless an OTLP endpoint is configured.

``init_tracing(service)`` is called once per serving process (router, each worker's control plane; engine
processes never trace: their stage times reach the control plane with their events). With neither
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` nor ``OTEL_EXPORTER_OTLP_ENDPOINT`` set it does nothing and every
helper here returns at its first line: no OpenTelemetry import, no span, no ``traceparent`` header.
With one set, spans go out over OTLP/HTTP (protobuf) through the SDK's batch processor; the standard
``OTEL_*`` variables (service name, resource attributes, batch delays, sampler) apply as usual.

Context crosses processes as a W3C ``traceparent`` header on the internal calls (router -> decode worker
-> prefill worker). Spans whose context another process needs (the router's request, the decode worker's
generate call, the prefill worker's prefill) are started live; the stages inside them are recorded as
timeline stamps (common/observability/timeline.py) and turned into child spans with their real start and
end times when the request ends (``child_spans``), so the hot path only takes timestamps.
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
    """Turns tracing on for this process when an OTLP endpoint is set; True when on. Idempotent."""
    global _tracer
    env = os.environ if environ is None else environ
    if _tracer is not None or not any(env.get(v) for v in ENDPOINT_VARS):
        return _tracer is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, when set, win over the role's default name.
    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    # A provider of our own, not the global one: libraries that trace through the global provider (FastAPI's
    # native telemetry spans every request, the router's /load polls included) stay off unless configured.
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
    """A live span (None when tracing is off), child of the remote context in ``parent_traceparent`` if any.
    ``start``: wall-clock seconds (default now)."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({"traceparent": parent_traceparent}) if parent_traceparent else None
    return _tracer.start_span(name, context=ctx, start_time=_ns(start), attributes=attributes)


def traceparent(span: Any) -> str | None:
    """The W3C traceparent naming ``span`` as the parent, for an outgoing internal call."""
    if span is None:
        return None
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def trace_id(span: Any) -> str | None:
    return None if span is None else f"{span.get_span_context().trace_id:032x}"


def child_spans(parent: Any, spans: list[tuple[str, float, float]], attributes: dict[str, Any] | None = None) -> None:
    """Records finished children of ``parent``: (name, start, end) in wall-clock seconds."""
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
