"""The router's Prometheus metrics (docs/architecture.md, "Metrics"). Several router processes share them
through prometheus-client's multiprocess mode (router/main.py sets the directory); per token the router only
bumps a local bucket (``TokenGaps``), and values reach Prometheus once per request.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from common.observability import buckets
from common.slo import DEFAULT_SLO_SPEC, parse_slo_classes

__all__ = ["CONTENT_TYPE_LATEST", "MULTIPROC_ENV", "RouterMetrics", "TokenGaps", "prepare_multiprocess_dir"]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class TokenGaps:
    """One choice's inter-token gaps, bucketed locally and added to the histogram once, at the request's end."""

    __slots__ = ("counts", "total", "last", "itl_target_s", "over")

    def __init__(self, n_buckets: int, itl_target_s: float = 0.0) -> None:
        self.counts = [0] * n_buckets
        self.total = 0.0
        self.last: float | None = None
        self.itl_target_s = itl_target_s  # its SLO class's ITL target (0: none)
        self.over = 0  # tokens whose gap exceeded it

    def add(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        last, self.last = self.last, now
        if last is None or tokens <= 0:
            return  # the first tokens: their wait is the TTFT, not a gap
        gap = now - last
        self.counts[bisect_left(ITL_BOUNDS, gap / tokens)] += tokens
        self.total += gap
        if self.itl_target_s and gap / tokens > self.itl_target_s:
            self.over += tokens

    def within(self, percentile: float) -> bool:
        """Whether the `percentile`-th percentile of these gaps is within the ITL target."""
        return self.over <= int(sum(self.counts) * (1 - percentile / 100) + 1e-9)


ITL_BOUNDS = (*buckets.STEP_S, float("inf"))


class _PoolView(Collector):
    def __init__(self, workers: Callable[[], Iterable[Any]]) -> None:
        self.workers = workers

    def collect(self) -> Iterable[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "kvferry_router_worker_up", "1 while the router routes to this worker", labels=["role", "worker"]
        )
        for w in self.workers():
            g.add_metric([w.role, w.pod or w.url], 1.0 if w.up else 0.0)
        yield g


# Label values known up front are exported at 0, so a panel shows 0 rather than "no data" until the first event.
MIGRATION_OUTCOMES = ("started", "succeeded", "failed")  # router/upstream/migration.py MigrationStats
PREFIX_LOOKUP_RESULTS = ("hit", "miss", "skipped")  # router/decision/dispatch.py
DEFAULT_SLO_CLASSES = parse_slo_classes(DEFAULT_SLO_SPEC).names  # the deployment's own: declare_classes
# Measured over predicted TTFT: 1 is exact; the buckets resolve a factor of 1.25 either side and the tails.
PREDICTION_RATIO = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)


class RouterMetrics:
    def __init__(self, slo_classes: Iterable[str] = DEFAULT_SLO_CLASSES) -> None:
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV) or None
        self.registry = r = CollectorRegistry()
        self._pool: Callable[[], Iterable[Any]] = lambda: ()
        self._declare_request_histograms(r)
        self._declare_traffic_counters(r)
        self._declare_slo_metrics(r)
        self.declare_classes(slo_classes)
        for outcome in MIGRATION_OUTCOMES:
            self.migrations.labels(outcome=outcome)
        for result in PREFIX_LOOKUP_RESULTS:
            self.prefix_lookups.labels(result=result)
        if self.multiprocess_dir is None:
            r.register(_PoolView(lambda: self._pool()))

    def _declare_request_histograms(self, r: CollectorRegistry) -> None:
        """Per-request latencies and sizes."""
        self.ttft = Histogram(
            "kvferry_router_time_to_first_token_seconds",
            "Request received until every choice's first token was in the router",
            buckets=buckets.LATENCY_S,
            registry=r,
        )
        self.gc_pause = Histogram(
            "kvferry_router_gc_pause_seconds",
            "Each garbage collection of a router process: every stream it relays waits that long",
            buckets=buckets.STEP_S,
            registry=r,
        )
        self.itl = Histogram(
            "kvferry_router_inter_token_latency_seconds",
            "Gap between a choice's successive tokens as they reached the router",
            buckets=buckets.STEP_S,
            registry=r,
        )
        self.e2e = Histogram(
            "kvferry_router_e2e_request_latency_seconds",
            "Request received until its last byte was handed on",
            buckets=buckets.LATENCY_S,
            registry=r,
        )
        self.dispatch = Histogram(
            "kvferry_router_time_to_dispatch_seconds",
            "Request received until it was written to a decode worker (tokenize, prefix lookup, routing)",
            buckets=buckets.LATENCY_S,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "kvferry_router_prompt_tokens", "Prompt tokens of one request", buckets=buckets.TOKENS, registry=r
        )
        # exact, where the histogram's power-of-two buckets put a prompt's square anywhere in [1/4, 9/4] of it
        # (uniform 1,000-3,000-token prompts: mean square +32%); the planner sizes prefill attention by its mean
        self.prompt_tokens_squared = Counter(
            "kvferry_router_prompt_tokens_squared", "Sum of served requests' squared prompt lengths", registry=r
        )
        self.output_tokens = Histogram(
            "kvferry_router_output_tokens",
            "Tokens generated for one request (all choices)",
            buckets=buckets.TOKENS,
            registry=r,
        )

    def _declare_traffic_counters(self, r: CollectorRegistry) -> None:
        """Requests, routing decisions, retries, migrations and prefix lookups as they happen."""
        self.requests = Counter(
            "kvferry_router_requests_total", "Requests by HTTP status and outcome", ["status", "outcome"], registry=r
        )
        self.http_requests = Counter(
            "kvferry_router_http_requests_total",
            "HTTP responses by method, route template and status",
            ["method", "route", "status"],
            registry=r,
        )
        self.decisions = Counter(
            "kvferry_router_routing_decisions_total",
            "Routing decisions and admission rejections",
            ["decision"],
            registry=r,
        )
        self.retries = Counter(
            "kvferry_router_retries_total",
            "Upstream attempts retried on other workers before the first token",
            registry=r,
        )
        self.migrations = Counter(
            "kvferry_router_migrations_total", "Streams continued on another decode worker", ["outcome"], registry=r
        )
        self.prefix_lookups = Counter(
            "kvferry_router_prefix_lookups_total", "Prefix-index lookups by result", ["result"], registry=r
        )
        self.redis_errors = Counter(
            "kvferry_router_redis_errors_total", "Prefix-index lookups Redis did not answer", registry=r
        )
        self.prompt_cached_tokens = Counter(
            "kvferry_router_prompt_cached_tokens_total",
            "Prompt tokens the worker placed to prefill already held (prefix index), at each placement",
            registry=r,
        )
        self.inflight = Gauge(
            "kvferry_router_inflight_requests",
            "Requests in the router",
            registry=r,
            multiprocess_mode="livesum",
        )

    def _declare_slo_metrics(self, r: CollectorRegistry) -> None:
        """Per-SLO-class outcomes (labelled by class) and the accuracy of the TTFT prediction."""
        slo = ("slo_class",)
        self.slo_requests = Counter(
            "kvferry_router_slo_requests_total", "Requests served, by SLO class", slo, registry=r
        )
        self.slo_ttft_met = Counter(
            "kvferry_router_slo_ttft_met_total", "Requests served within their class's TTFT target", slo, registry=r
        )
        self.slo_itl_met = Counter(
            "kvferry_router_slo_itl_met_total",
            "Requests served whose own inter-token gaps held their class's ITL target (at its percentile)",
            slo,
            registry=r,
        )
        self.slo_good = Counter(
            "kvferry_router_slo_good_total", "Requests served within both targets (goodput)", slo, registry=r
        )
        self.slo_shed = Counter(
            "kvferry_router_slo_shed_total", "Requests refused (429) by predicted TTFT", slo, registry=r
        )
        self.ttft_prediction = Histogram(
            "kvferry_router_ttft_prediction_ratio",
            "Measured over predicted TTFT of a served request (1: exact)",
            buckets=PREDICTION_RATIO,
            registry=r,
        )
        self.remote_excess = Gauge(
            "kvferry_router_remote_prefill_excess_seconds",
            "What adaptive placement adds to a remote prefill's predicted TTFT: its measured excess over a local one's "
            "(router/decision/remote_excess.py; the largest of the router processes')",
            registry=r,
            multiprocess_mode="livemax",
        )

    def declare_classes(self, names: Iterable[str]) -> None:
        """Exports every declared SLO class's counters from 0."""
        for name in names:
            for c in (self.slo_requests, self.slo_ttft_met, self.slo_itl_met, self.slo_good, self.slo_shed):
                c.labels(slo_class=name)

    def observe_slo(self, slo_class: str, ttft_met: bool, itl_met: bool) -> None:
        self.slo_requests.labels(slo_class=slo_class).inc()
        if ttft_met:
            self.slo_ttft_met.labels(slo_class=slo_class).inc()
        if itl_met:
            self.slo_itl_met.labels(slo_class=slo_class).inc()
        if ttft_met and itl_met:
            self.slo_good.labels(slo_class=slo_class).inc()

    def watch_pool(self, workers: Callable[[], Iterable[Any]]) -> None:
        self._pool = workers

    def add_gaps(self, gaps: TokenGaps) -> None:
        """Adds one choice's gaps bucket by bucket (``observe`` per token would take a lock per token)."""
        if gaps.total == 0.0 and not any(gaps.counts):
            return
        hist = self.itl
        for i, n in enumerate(gaps.counts):
            if n:
                hist._buckets[i].inc(n)  # the histogram's own per-bucket values, as observe() bumps them
        hist._sum.inc(gaps.total)

    def new_gaps(self, itl_target_s: float = 0.0) -> TokenGaps:
        return TokenGaps(len(ITL_BOUNDS), itl_target_s)

    def exposition(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, self.multiprocess_dir)
        registry.register(_PoolView(lambda: self._pool()))
        return generate_latest(registry)


def prepare_multiprocess_dir() -> str:
    """A directory for several router processes' values (PROMETHEUS_MULTIPROC_DIR emptied, or a fresh one)."""
    path = os.environ.get(MULTIPROC_ENV)
    if path:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):
            if name.endswith(".db"):
                os.unlink(os.path.join(path, name))
    else:
        import tempfile

        path = tempfile.mkdtemp(prefix="kvferry-router-metrics-")
    os.environ[MULTIPROC_ENV] = path
    return path
