"""Tracing (common/observability/tracing.py): off by default at no cost, and W3C traceparent honoured when on.
The cross-process trace of a real request is checked in tests/test_metrics.py (router -> decode -> prefill)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import wait_until
from tests.otlp_collector import OtlpCollector

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_off_without_an_endpoint_loads_nothing_and_sends_no_header() -> None:
    out = _run(
        """
import sys
from common.observability import tracing
from common.worker.request_trace import WorkerTrace
assert tracing.init_tracing("kvferry-test") is False
assert tracing.start_span("x", "00-" + "1" * 32 + "-" + "2" * 16 + "-01") is None
w = WorkerTrace("decode generate", "r1", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")
assert w.headers() == {} and w.span is None
w.end(())
print(sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk") or m.startswith("opentelemetry.exporter")))
""",
        {},
    )
    assert out.strip() == "[]"


def test_spans_continue_the_callers_trace_and_reach_the_collector() -> None:
    collector = OtlpCollector()
    try:
        parent_trace, parent_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        out = _run(
            f"""
import time
from common.observability import tracing
assert tracing.init_tracing("kvferry-test")
span = tracing.start_span("prefill", "00-{parent_trace}-{parent_span}-01", time.time())
now = time.time()
tracing.child_spans(span, [("kv transfer", now, now + 0.002)])
tracing.end_span(span, now + 0.003)
print(tracing.traceparent(span))
""",
            {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "50"},
        )
        version, trace_id, span_id, flags = out.strip().split("-")
        assert (version, trace_id, flags) == ("00", parent_trace, "01") and len(span_id) == 16
        wait_until(lambda: len(collector.trace(parent_trace)) >= 2, 10, "both spans at the collector")
        spans = {s.name: s for s in collector.trace(parent_trace)}
        assert spans["prefill"].parent_span_id == parent_span and spans["prefill"].span_id == span_id
        assert spans["prefill"].service == "kvferry-test"
        child = spans["kv transfer"]
        assert child.parent_span_id == span_id
        assert child.end_ns - child.start_ns == 2_000_000 or abs(child.end_ns - child.start_ns - 2_000_000) < 1000
    finally:
        collector.close()
