"""Where a point's requests spent their time inside the workers: each worker's stage histograms
(common/worker/engine_metrics.py) read from its /metrics before and after the point, as the mean of what the point
added (seconds and count). A disaggregated TTFT is the decode worker's queue for pages, the remote prefill (the
prefill worker's queue and compute, the KV transfer and its notice) and the first token's way out; an aggregated
one the queue and the local prefill. The router's side is in bench/serve_predictions.py."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

# the stage histograms a worker publishes, by the name each phase is reported under
PHASES = {
    "queue": "kvferry_request_queue_time_seconds",
    "prefill": "kvferry_prefill_time_seconds",
    "remote_prefill": "kvferry_remote_prefill_seconds",
    "ttft": "kvferry_time_to_first_token_seconds",
    "kv_transfer": "kvferry_kv_transfer_seconds",
    "kv_transfer_tail": "kvferry_kv_transfer_tail_seconds",
}
# Garbage collections, read as phases (seconds and count since the process started): the worker's HTTP process and
# the router's processes (histograms, with how many took SLOW_COLLECTION_S or more: a token gap every stream they
# relay shares) and the engine's (gauges). A shared gap over the ITL target with a slow one beside it names its source.
COLLECTIONS = {
    "gc_http": ("kvferry_worker_gc_pause_seconds_sum", "kvferry_worker_gc_pause_seconds_count"),
    "gc_router": ("kvferry_router_gc_pause_seconds_sum", "kvferry_router_gc_pause_seconds_count"),
    "gc_engine": ("kvferry_engine_gc_pause_seconds", "kvferry_engine_gc_collections"),
}
SLOW_COLLECTION_S = "0.03"  # a bucket edge of common/observability/buckets.py STEP_S
SLOW_SUFFIX = f"_over_{float(SLOW_COLLECTION_S) * 1e3:.0f}ms"  # a collections phase's count of slow ones
# Labelled counters read as counts, one per label value (`<name>_<value>`): a worker's steps beside decoding past
# its ITL target, by cause (its chunk, or a host stall between steps: common/sched/itl_trim.py), and the router's
# decisions, summed over its processes (each process's /router/workers counts only its own).
COUNTS = {"kvferry_slow_steps_total": "slow_steps", "kvferry_router_routing_decisions_total": "decision"}
# Unlabelled counts: the engine's device allocator retries (common/engine/allocator_stats.py), each a host stall.
PLAIN_COUNTS = {"kvferry_engine_alloc_retries": "alloc_retries"}
Totals = dict[str, dict[str, tuple[float, float]]]  # worker -> phase -> (sum of seconds, count)


def read_totals(workers: dict[str, str], timeout_s: float = 5.0) -> Totals:
    """Each worker's (name -> base URL) stage histograms' sums and counts now; a worker that does not answer is
    left out."""
    totals: Totals = {}
    for name, url in workers.items():
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as resp:
                text = resp.read().decode()
        except (OSError, urllib.error.URLError):
            continue
        totals[name] = parse_totals(text)
    return totals


def parse_totals(text: str) -> dict[str, tuple[float, float]]:
    """The phases' (sum, count) from a Prometheus text exposition (unlabelled histograms), the collections and the
    labelled counts (a sum of 0)."""
    values: dict[str, float] = {}
    counts: dict[str, tuple[float, float]] = {}
    slow_edge = f'_bucket{{le="{SLOW_COLLECTION_S}"}} '
    for line in text.splitlines():
        if not line.startswith("kvferry_"):
            continue
        key, _, value = line.partition(" ")
        if "{" not in key or slow_edge in line:  # unlabelled series, and the collections' slow edge
            values[key] = float(value)
        name, _, label = key.partition("{")
        if name in COUNTS and label.count('"') == 2:
            counts[COUNTS[name] + "_" + label.split('"')[1]] = (0.0, float(value))
    totals = {
        phase: (values.get(f"{metric}_sum", 0.0), values.get(f"{metric}_count", 0.0))
        for phase, metric in PHASES.items()
        if f"{metric}_count" in values
    }
    for phase, (seconds, count) in COLLECTIONS.items():
        if count not in values:
            continue
        totals[phase] = (values.get(seconds, 0.0), values[count])
        within = values.get(count.removesuffix("_count") + slow_edge.rstrip())
        if within is not None:  # a histogram: those past the edge, as a count alone
            totals[phase + SLOW_SUFFIX] = (0.0, values[count] - within)
    for metric, phase in PLAIN_COUNTS.items():
        if metric in values:
            totals[phase] = (0.0, values[metric])
    return totals | counts


def phase_means(before: Totals, after: Totals) -> dict[str, dict[str, Any]]:
    """What each worker's phases added between two readings: mean milliseconds and count, phases with none left
    out."""
    out: dict[str, dict[str, Any]] = {}
    for name, now in after.items():
        then = before.get(name, {})
        phases = {}
        for phase, (total, count) in now.items():
            t0, c0 = then.get(phase, (0.0, 0.0))
            if count > c0:  # a count alone (a sum of 0: slow collections) has no mean
                mean = {"mean_ms": round((total - t0) / (count - c0) * 1e3, 3)} if total > t0 else {}
                phases[phase] = {**mean, "n": int(count - c0)}
        if phases:
            out[name] = phases
    return out
