"""What the planner reads from the routers over HTTP (``/metrics`` and ``/router/workers``): every router's
counters summed (a headless Service's every address), the workers' view from the first that answers (each
router polls every worker).
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from common.capacity import StepCost
from planner.observe import Totals, queue_wait_s
from planner.sizing import Counts

__all__ = ["FleetView", "expand_urls", "median_cost", "median_of", "parse_totals", "parse_workers", "read"]

PREFILL_SIDE = ("prefill",)  # where a prefill pod exists, the queue that matters is its; else decode/mixed


@dataclass(frozen=True)
class FleetView:
    totals: Totals
    queue_wait_s: float
    ready: Counts
    cost: StepCost | None  # the median of the workers' fitted coefficients (None: none has fitted yet)


def expand_urls(urls: Iterable[str]) -> list[str]:
    """Each URL, or for a host that resolves to several addresses (a headless Service), one URL per address."""
    out: list[str] = []
    for url in urls:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
        try:
            addrs = sorted({info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})
        except OSError:
            addrs = [host]
        for addr in addrs if len(addrs) > 1 else [host]:
            netloc = f"[{addr}]" if ":" in addr else addr
            out.append(urlunsplit(parts._replace(netloc=f"{netloc}:{port}" if port else netloc)))
    return out


def parse_totals(text: str, t: float) -> Totals:
    sums: dict[str, float] = {}
    shed = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "kvferry_router_routing_decisions_total" and sample.labels.get("decision", "").startswith(
                "rejected-"
            ):
                shed += sample.value
            elif name in (
                "kvferry_router_requests_total",
                "kvferry_router_inflight_requests",
                "kvferry_router_prompt_tokens_sum",
                "kvferry_router_prompt_tokens_count",
                "kvferry_router_prompt_tokens_squared_total",
                "kvferry_router_output_tokens_sum",
                "kvferry_router_prompt_cached_tokens_total",
            ):
                sums[name] = sums.get(name, 0.0) + sample.value
    return Totals(
        t=t,
        # a request is counted in requests_total when it ends: with those still in the router, when it arrived
        # (under a growing queue the finished ones alone read the throughput, not the offered load)
        requests=sums.get("kvferry_router_requests_total", 0.0) + sums.get("kvferry_router_inflight_requests", 0.0),
        served=sums.get("kvferry_router_prompt_tokens_count", 0.0),
        prompt_tokens=sums.get("kvferry_router_prompt_tokens_sum", 0.0),
        prompt_sq_tokens=sums.get("kvferry_router_prompt_tokens_squared_total", 0.0),
        output_tokens=sums.get("kvferry_router_output_tokens_sum", 0.0),
        cached_tokens=sums.get("kvferry_router_prompt_cached_tokens_total", 0.0),
        shed=shed,
    )


def parse_workers(view: dict) -> tuple[float, Counts, StepCost | None]:
    """(queue wait, routable replicas per role, median step cost) from one router's /router/workers."""
    workers = view.get("placement", {}).get("workers", {})
    up = [w for w in workers.values() if w.get("up")]
    ready = {role: sum(1 for w in up if w.get("role") == role) for role in ("prefill", "decode", "mixed")}
    side = PREFILL_SIDE if ready["prefill"] else ("decode", "mixed")
    wait = queue_wait_s(
        (float(w.get("queued_prefill_tokens", 0)), float(w.get("prefill_tokens_per_s", 0.0)))
        for w in up
        if w.get("role") in side
    )
    return wait, Counts(**ready), median_cost(up)


def median_of(costs: Sequence[StepCost]) -> StepCost:
    """Each coefficient's median over `costs`."""
    return StepCost(**{k: statistics.median(getattr(c, k) for c in costs) for k in StepCost.__dataclass_fields__})


def median_cost(workers: Iterable[Mapping[str, Any]]) -> StepCost | None:
    """What the planner sizes with: the median of the workers' fitted coefficients (None: none has fitted)."""
    costs = [StepCost.from_map(w["step_coefficients"]) for w in workers if w.get("step_coefficients")]
    costs = [c for c in costs if c.known]
    return median_of(costs) if costs else None


def read(client: httpx.Client, routers: list[str], t: float, headers: dict[str, str] | None = None) -> FleetView:
    """Sums every router's counters, the workers' view from the first that answers; raises when none answers."""
    totals: list[Totals] = []
    workers = None
    for url in expand_urls(routers):
        try:
            m = client.get(f"{url}/metrics", headers=headers)
            m.raise_for_status()
            totals.append(parse_totals(m.text, t))
            if workers is None:
                w = client.get(f"{url}/router/workers", headers=headers)
                w.raise_for_status()
                workers = w.json()
        except (httpx.HTTPError, ValueError):
            continue
    if not totals or workers is None:
        raise ConnectionError(f"no router answered: {', '.join(routers)}")
    wait, ready, cost = parse_workers(workers)
    total = Totals(t, **{k: sum(getattr(x, k) for x in totals) for k in Totals.__dataclass_fields__ if k != "t"})
    return FleetView(total, wait, ready, cost)
