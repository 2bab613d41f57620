"""A tiny OTLP/HTTP trace collector for tests: receives the protobuf exports the SDK sends, keeps the spans."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int


class OtlpCollector:
    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list[ReceivedSpan] = []
        lock = self.lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                export = ExportTraceServiceRequest.FromString(body)
                with lock:
                    for rs in export.resource_spans:
                        attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                spans.append(
                                    ReceivedSpan(
                                        attrs.get("service.name", ""),
                                        s.name,
                                        s.trace_id.hex(),
                                        s.span_id.hex(),
                                        s.parent_span_id.hex(),
                                        s.start_time_unix_nano,
                                        s.end_time_unix_nano,
                                    )
                                )
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
