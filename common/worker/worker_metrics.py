"""A worker's Prometheus metrics: the engine's load as gauges, request outcomes and token counts, and the
engine's latency and transfer histograms (common/worker/engine_metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.observability import buckets
from common.protocol import FinishReason, LoadSnapshot
from common.worker.engine_metrics import EngineMetrics


@dataclass
class WorkerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    gpu: bool = False  # the engine's KV pool is on a GPU (transfers slower than NVLink are worth a warning)

    def __post_init__(self) -> None:
        r = self.registry
        self.queued = Gauge("kvferry_prefill_queued_tokens", "Prompt tokens waiting for prefill", registry=r)
        self.running = Gauge("kvferry_running_requests", "Requests admitted and not finished", registry=r)
        self.waiting = Gauge("kvferry_waiting_requests", "Requests queued for admission", registry=r)
        self.free = Gauge("kvferry_kv_pages_free", "KV pages free or reclaimable", registry=r)
        self.total = Gauge("kvferry_kv_pages_total", "KV pages in the pool", registry=r)
        self.usage = Gauge("kvferry_kv_usage_ratio", "Share of KV pages in use", registry=r)
        # What the router's placement model reads (router/cost_model.py), as the worker publishes it in /load.
        self.prefill_rate = Gauge(
            "kvferry_prefill_tokens_per_second",
            "Prompt tokens prefilled per second while prompts were queued",
            registry=r,
        )
        self.prefill_step_speed = Gauge(
            "kvferry_prefill_step_tokens_per_second",
            "Device-timed prefill speed (what a chunk adds to a step)",
            registry=r,
        )
        self.decode_step = Gauge("kvferry_decode_step_seconds_recent", "Recent decode step time, smoothed", registry=r)
        self.prefill_chunk = Gauge(
            "kvferry_prefill_chunk_tokens", "Prompt tokens one step takes beside the requests it decodes", registry=r
        )
        self.itl_target = Gauge(
            "kvferry_itl_target_seconds", "The ITL the steps beside decoding requests aim at (0: none)", registry=r
        )
        self.host_cached = Gauge(
            "kvferry_host_kv_pages_cached", "Host KV tier: pages holding cached prefixes", registry=r
        )
        self.host_total = Gauge(
            "kvferry_host_kv_pages_total", "Host KV tier: pages in the tier (0: no tier)", registry=r
        )
        self.host_locked = Gauge(
            "kvferry_host_kv_pages_locked",
            "Host KV tier: pages page-locked so far (the tier is used once all of the total are)",
            registry=r,
        )
        self.host_moves = Counter(
            "kvferry_host_kv_pages_moved_total",
            "Host KV tier: pages copied out of the device pool (saved) or back into it (loaded)",
            ["direction"],
            registry=r,
        )
        self._host_moved = {"saved": 0, "loaded": 0}
        self.preemptions = Counter(
            "kvferry_preemptions_total",
            "Running requests preempted for KV pages, by what became of their KV (parked in the host tier or "
            "recomputed)",
            ["mode"],
            registry=r,
        )
        self.recomputed = Counter(
            "kvferry_recomputed_tokens_total", "Tokens prefilled again that had KV before a preemption", registry=r
        )
        self._preempt_seen = {"park": 0, "recompute": 0, "tokens": 0}
        self.slow_steps = Counter(
            "kvferry_slow_steps_total",
            "Steps beside decoding past the ITL target, by cause: their prompt chunk (the budget is trimmed for "
            "each) or a host stall between steps",
            ["cause"],
            registry=r,
        )
        self._slow_seen = {"chunk": 0, "stall": 0}
        # The engine process's garbage collections since it started (common/gc_pauses.py).
        self.gc_collections = Gauge(
            "kvferry_engine_gc_collections", "Engine garbage collections since start", registry=r
        )
        self.gc_pause = Gauge(
            "kvferry_engine_gc_pause_seconds", "Seconds the engine spent in garbage collection since start", registry=r
        )
        self.gc_pause_max = Gauge(
            "kvferry_engine_gc_pause_max_seconds", "The engine's longest garbage collection since start", registry=r
        )
        self.alloc_retries = Gauge(
            "kvferry_engine_alloc_retries",
            "The engine's device allocator retries since start: each freed its cache and synchronized (a host stall)",
            registry=r,
        )
        self.http_gc_pause = Histogram(
            "kvferry_worker_gc_pause_seconds",
            "Each garbage collection of the worker's HTTP process: every stream it relays waits that long",
            buckets=buckets.STEP_S,
            registry=r,
        )
        self.requests = Counter("kvferry_requests_total", "Finished requests by outcome", ["outcome"], registry=r)
        # The latest engine start (common/engine/start_phases.py): each phase that ran, and the whole of it.
        self.start_phase = Gauge(
            "kvferry_worker_start_phase_seconds",
            "Seconds the latest engine start spent in each phase (weights, kernels, graphs, warm_up)",
            ["phase"],
            registry=r,
        )
        self.start = Gauge(
            "kvferry_worker_start_seconds", "Seconds from the latest engine process start to its Ready", registry=r
        )
        for outcome in get_args(FinishReason):  # at 0 from the start: a panel shows 0, not "no data"
            self.requests.labels(outcome=outcome)
        for direction in self._host_moved:
            self.host_moves.labels(direction=direction)
        for mode in ("park", "recompute"):
            self.preemptions.labels(mode=mode)
        for cause in self._slow_seen:
            self.slow_steps.labels(cause=cause)
        self.engine_restarts = Counter(
            "kvferry_engine_restarts_total", "Engine processes started again after one died", registry=r
        )
        self.cached = Counter(
            "kvferry_prefix_cached_tokens_total", "Prompt tokens served from the prefix cache", registry=r
        )
        self.prompt = Counter("kvferry_prompt_tokens_total", "Prompt tokens received", registry=r)
        self.generated = Counter("kvferry_generated_tokens_total", "Tokens generated", registry=r)
        self.kv_integrity_violations = Counter(
            "kvferry_kv_integrity_violations_total", "KV page ledger violations found by the idle check", registry=r
        )
        self.kv_forced_releases = Counter(
            "kvferry_kv_forced_releases_total",
            "KV pages freed at the safety deadline, unconfirmed by the peer",
            registry=r,
        )
        # Latency and transfer histograms (common/worker/engine_metrics.py).
        self.engine = EngineMetrics(r, gpu=self.gpu)

    def forget_engine(self) -> None:
        """The engine died: its pool and queues are gone with it, so the gauges read zero until the next one
        reports (a dead engine's last numbers would say pages are free that no process holds)."""
        for g in (self.queued, self.running, self.waiting, self.free, self.total, self.usage, self.host_cached):
            g.set(0)
        self.host_total.set(0)
        self.host_locked.set(0)
        self._host_moved = {"saved": 0, "loaded": 0}  # the next engine counts from zero
        self._preempt_seen = {"park": 0, "recompute": 0, "tokens": 0}

    def observe_start(self, phases: dict[str, float], seconds: float) -> None:
        self.start_phase.clear()  # a restarted engine's phases replace the last one's (it may run fewer)
        for phase, took in phases.items():
            self.start_phase.labels(phase=phase).set(took)
        self.start.set(seconds)

    def observe_load(self, load: LoadSnapshot) -> None:
        self.queued.set(load.queued_prefill_tokens)
        self.running.set(load.running_requests)
        self.waiting.set(load.waiting_requests)
        self.free.set(load.free_pages)
        self.total.set(load.total_pages)
        self.usage.set(1.0 - load.free_pages / max(1, load.total_pages))
        self.prefill_rate.set(load.prefill_tokens_per_s)
        self.prefill_step_speed.set(load.prefill_step_tokens_per_s)
        self.decode_step.set(load.decode_step_s)
        self.prefill_chunk.set(load.prefill_chunk_tokens)
        self.itl_target.set(load.itl_target_s)
        self.host_cached.set(load.host_pages_cached)
        self.host_total.set(load.host_pages_total)
        self.host_locked.set(load.host_pages_locked)
        self.gc_collections.set(load.gc_collections)
        self.gc_pause.set(load.gc_pause_s)
        self.gc_pause_max.set(load.gc_pause_max_s)
        self.alloc_retries.set(load.alloc_retries)
        for direction, now in (("saved", load.host_pages_saved), ("loaded", load.host_pages_loaded)):
            if now > self._host_moved[direction]:  # cumulative in the engine: count the increase
                self.host_moves.labels(direction=direction).inc(now - self._host_moved[direction])
                self._host_moved[direction] = now
        parked = load.preemptions_parked
        for key, now in (
            ("park", parked),
            ("recompute", load.preemptions - parked),
            ("tokens", load.recomputed_tokens),
        ):
            if now > self._preempt_seen[key]:  # cumulative in the engine: count the increase
                counter = self.recomputed if key == "tokens" else self.preemptions.labels(mode=key)
                counter.inc(now - self._preempt_seen[key])
                self._preempt_seen[key] = now
        for cause, now in (("chunk", load.step_overruns), ("stall", load.step_stalls)):
            if now > self._slow_seen[cause]:
                self.slow_steps.labels(cause=cause).inc(now - self._slow_seen[cause])
                self._slow_seen[cause] = now
