"""One request's record in the router: its stage timeline, trace span and metrics. ``finish`` (first call wins)
counts the request, ends its span and keeps the record for ``GET /debug/requests/{id}`` in this router process
(with several processes on one port, ask the one that served it, or read the DEBUG log line).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.observability import tracing
from common.observability.timeline import Stamps, offsets_ms, spans_between
from common.slo import SloClass
from router.metrics import RouterMetrics, TokenGaps

log = logging.getLogger("kvferry.router.requests")

__all__ = ["RequestLog", "RequestRecord"]

# (span name, from stage, to stage): the router span's children.
ROUTER_SPANS = (
    ("tokenize", "router_received", "tokenized"),
    ("route", "tokenized", "dispatched"),
    ("wait for first token", "dispatched", "first_token_router"),
    ("stream", "first_token_router", "stream_end"),
)


@dataclass
class RequestRecord:
    owner: RequestLog
    stream: bool
    span: Any
    stamps: Stamps = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)  # durations come from the monotonic clock
    rid: str = ""
    prompt_tokens: int = 0
    decision: str | None = None
    status: int | None = None  # set when finished
    outcome: str = ""
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    slo: SloClass | None = None  # the request's SLO class (None: not counted per class)
    predicted_ttft_s: float | None = None  # its placement's predicted TTFT (router/decision/dispatch.py)
    on_first_token: list[Callable[[], None]] = field(default_factory=list)  # its prompts are queued no more

    def mark(self, stage: str) -> None:
        self.stamps[stage] = time.time()

    def traceparent(self) -> str | None:
        return tracing.traceparent(self.span)

    def prepared(self, rid: str, prompt_tokens: int) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.mark("tokenized")

    def dispatched(self, decision: str) -> None:
        """The generate request is being written to the decode worker (a retry stamps again)."""
        self.decision = decision
        if "dispatched" not in self.stamps:
            self.owner.metrics.dispatch.observe(time.monotonic() - self.started)
        self.mark("dispatched")

    def upstream(self, worker_stamps: dict[str, float] | None) -> None:
        """The decode worker's first event: the workers' stamps; the first choice's win."""
        if worker_stamps and "decode_received" not in self.stamps:
            for stage, t in worker_stamps.items():
                if isinstance(t, int | float):
                    self.stamps.setdefault(stage, float(t))

    def first_token(self, choices: list[Any]) -> None:
        """Every choice's first event is in: from here their tokens' gaps are counted."""
        self.mark("first_token_router")
        self.ttft_s = time.monotonic() - self.started
        for done in self.on_first_token:
            done()
        self.on_first_token.clear()
        self.owner.metrics.ttft.observe(self.ttft_s)
        itl = self.slo.itl_s if self.slo is not None else 0.0
        for c in choices:
            c.gaps = self.owner.metrics.new_gaps(itl)

    def finish_choices(self, status: int, choices: list[Any], client_gone: bool = False) -> None:
        """Finishes with the outcome of the first choice that did not stop or hit its length ("abort": client gone)."""
        outcome = "abort" if client_gone else ""
        for c in choices:
            reason = c.state.finish_reason if c.state.finished else "abort"
            if not outcome or outcome in ("stop", "length"):
                outcome = reason or "abort"
        output = sum(c.state.completion_tokens for c in choices)
        self.finish(status, outcome or "error", output, [c.gaps for c in choices if c.gaps is not None])

    def finish(self, status: int, outcome: str, output_tokens: int = 0, gaps: list[TokenGaps] = ()) -> None:  # type: ignore[assignment]
        """Counts the request (the first call only); outcome "rejected" for an error status."""
        if self.status is not None:
            return
        self.status, self.outcome, self.output_tokens = status, outcome, output_tokens
        self.e2e_s = time.monotonic() - self.started
        self.mark("stream_end")
        m = self.owner.metrics
        m.requests.labels(status=str(status), outcome=outcome).inc()
        m.inflight.dec()
        if status < 400:
            m.e2e.observe(self.e2e_s)
            m.prompt_tokens.observe(self.prompt_tokens)
            m.prompt_tokens_squared.inc(self.prompt_tokens * self.prompt_tokens)
            m.output_tokens.observe(output_tokens)
            for g in gaps:
                m.add_gaps(g)
            self._observe_slo(m, gaps)
        if self.span is not None:
            tracing.child_spans(self.span, spans_between(self.stamps, ROUTER_SPANS))
            attrs = {"http.status_code": status, "kvferry.outcome": outcome, "kvferry.request_id": self.rid}
            if self.decision:
                attrs["kvferry.decision"] = self.decision
            tracing.end_span(self.span, attributes=attrs, error=outcome if outcome in ("error",) else None)
        self.owner.keep(self)

    def _observe_slo(self, m: RouterMetrics, gaps: list[TokenGaps]) -> None:
        """A served request against its class's targets, and the TTFT prediction against what it measured."""
        if self.ttft_s is None:
            return
        if self.predicted_ttft_s is not None and self.predicted_ttft_s > 0:
            m.ttft_prediction.observe(self.ttft_s / self.predicted_ttft_s)
        cls = self.slo
        if cls is None:
            return
        ttft_met = cls.ttft_s is None or self.ttft_s <= cls.ttft_s
        m.observe_slo(cls.name, ttft_met, all(g.within(cls.percentile) for g in gaps))

    def view(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "status": self.status,
            "outcome": self.outcome,
            "stream": self.stream,
            "decision": self.decision,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1e3, 3),
            "predicted_ttft_ms": None if self.predicted_ttft_s is None else round(self.predicted_ttft_s * 1e3, 3),
            "slo_class": None if self.slo is None else self.slo.name,
            "e2e_ms": None if self.e2e_s is None else round(self.e2e_s * 1e3, 3),
            "received_at": self.stamps.get("router_received"),  # wall clock, seconds
            "trace_id": tracing.trace_id(self.span),
            "stages": offsets_ms(self.stamps),
        }


class RequestLog:
    def __init__(self, metrics: RouterMetrics, keep: int = 1024) -> None:
        self.metrics = metrics
        self.max_kept = keep
        self.recent: OrderedDict[str, RequestRecord] = OrderedDict()

    def begin(self, stream: bool, traceparent: str | None, endpoint: str) -> RequestRecord:
        received = time.time()
        span = tracing.start_span(f"POST {endpoint}", traceparent, received, {"kvferry.stream": stream})
        self.metrics.inflight.inc()
        return RequestRecord(self, stream, span, {"router_received": received})

    def keep(self, rec: RequestRecord) -> None:
        if not rec.rid:
            return  # refused before it had an id
        self.recent[rec.rid] = rec
        while len(self.recent) > self.max_kept:
            self.recent.popitem(last=False)
        if log.isEnabledFor(logging.DEBUG):
            v = rec.view()
            stages = " ".join(f"{s['stage']}={s['t_ms']}" for s in v.pop("stages"))
            log.debug("request timeline", extra={**{k: x for k, x in v.items() if x is not None}, "stages_ms": stages})

    def get(self, rid: str) -> dict[str, Any] | None:
        rec = self.recent.get(rid)
        return None if rec is None else rec.view()

    def list(self, limit: int = 100, stages: bool = False) -> list[dict[str, Any]]:
        recs = list(self.recent.values())[-limit:]
        if stages:
            return [r.view() for r in reversed(recs)]
        return [{k: v for k, v in r.view().items() if k != "stages"} for r in reversed(recs)]
