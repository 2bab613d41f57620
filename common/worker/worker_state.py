"""The control plane's view of its engine process: the process, its channel, its latest load and readiness.

Busy does not look idle: a snapshot is only as new as the engine's last step, and a long prompt's step on a
CPU takes seconds, so what the engine accepted since its last snapshot (``AcceptedWork``) is added to it
(requests, prompt tokens to prefill, pages) until the next snapshot, which counts them itself, arrives.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.config import WorkerConfig
from common.loop_lag import LoopLag
from common.protocol import LoadSnapshot, replace
from common.worker.channel import EngineClient
from common.worker.messages import AgentInfo, Event, KVIntegrity, Load, Ready, Steps, Stop, Stopping
from common.worker.worker_metrics import WorkerMetrics

log = logging.getLogger("kvferry.control")


class LiveRequest(Protocol):
    """What the control plane's routes mark on a live request (common/worker/request.py ``WorkerRequest``)."""

    called_off: bool  # stopped by its caller (/internal/abort, a cancel): a failure counts as "abort"


@dataclass
class AcceptedWork:
    """Requests the engine accepted after its latest load snapshot was taken: that snapshot does not count
    them, and no newer one comes while the engine's current step runs (seconds for a long prompt on a CPU).
    Cleared by the next snapshot (computed after the engine took them in) or as each one ends."""

    page_size: int
    requests: dict[str, tuple[int, bool]] = field(default_factory=dict)  # id -> (prompt tokens, prefilled here)

    def add(self, req_id: str, prompt_tokens: int, prefill_here: bool) -> None:
        self.requests[req_id] = (prompt_tokens, prefill_here)

    def ended(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def onto(self, load: LoadSnapshot) -> LoadSnapshot:
        if not self.requests:
            return load
        tokens = sum(n for n, here in self.requests.values() if here)
        pages = sum(-(-n // self.page_size) for n, _ in self.requests.values())  # the prompt's, at least
        return replace(
            load,
            running_requests=load.running_requests + len(self.requests),
            queued_prefill_tokens=load.queued_prefill_tokens + tokens,
            free_pages=max(0, load.free_pages - pages),
        )


class WorkerState:
    """The control plane's view of its engine process."""

    def __init__(self, cfg: WorkerConfig, host_target: Callable[..., None], roles: tuple[str, ...]) -> None:
        self.cfg = cfg
        self.host_target = host_target
        self.roles = roles  # what builds the engine's parts (names: common/worker/roles.py), in its process
        self.metrics = WorkerMetrics(gpu=cfg.runner.device.startswith("cuda"))
        self.engine_ready = asyncio.Event()
        self.agent: AgentInfo | None = None  # the engine's, from its Ready event
        self.load: LoadSnapshot | None = None
        self.accepted = AcceptedWork(cfg.runner.page_size)  # what the engine took in since `load` was taken
        self.draining = False
        # The requests with an open stream here (generate or prefill, common/worker/request.py), from arrival
        # until the stream ends however it ends; counted as ``live_requests`` in /load, which the router
        # reconciles its own counts with.
        self.requests: dict[str, LiveRequest] = {}
        self.prompt_tokens_accepted = 0  # prompt tokens accepted to prefill here, a counter on /load
        self.decodes_accepted = 0  # requests accepted to decode here, a counter on /load
        self.proc: mp.process.BaseProcess | None = None
        self.client: EngineClient | None = None
        # The engine's events by type; a role's routes add theirs.
        self.event_handlers: dict[type, Callable[[Any], None]] = {
            Ready: self._on_ready,
            Load: self._on_load,
            Steps: lambda ev: self.metrics.engine.observe_steps(ev.decode),
            KVIntegrity: lambda ev: self.metrics.kv_integrity_violations.inc(ev.violations),
            Stopping: self._on_stopping,
        }
        # Called when the engine died and before its successor starts (routes drop what they knew of it).
        self.on_engine_lost: list[Callable[[], None]] = []
        self.engine_started_at = 0.0  # time.monotonic() of the latest engine start
        # This process writes each step's tokens to its streams one after another: its loop's lateness is this
        # worker's part of what the path after the engine adds to a stream's gaps (decode_worker/routes.py starts
        # it with the first stream; the lifespan stops it).
        self.relay_lag = LoopLag()
        self.restarts = 0  # engines started after the first
        self.restarting = False  # the engine died and its successor is not ready yet
        self.ever_ready = False  # an engine was ready once: one that dies now is restarted, not fatal

    @property
    def ready(self) -> bool:
        # Its first load snapshot in as well: a worker never says ready beside a /load of 0 pages.
        return self.engine_ready.is_set() and self.load is not None and not self.draining and self.alive

    @property
    def inflight(self) -> int:
        return len(self.requests)

    @property
    def alive(self) -> bool:
        return (
            self.proc is not None
            and self.proc.is_alive()
            and self.client is not None
            and not self.client.closed.is_set()
        )

    def start_engine(self) -> None:
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=self.host_target,
            args=(self.roles, self.cfg, theirs, time.time()),  # the spawn's time: the engine's `process` phase
            name=f"kvferry-{self.cfg.role}-engine",
            daemon=True,
        )
        self.proc.start()
        theirs.close()
        self.engine_started_at = time.monotonic()
        self.client = EngineClient(ours, asyncio.get_running_loop(), self._on_event)

    def forget_engine(self) -> None:
        """What the control plane knew of an engine that died: nothing of it is reported or used again."""
        self.engine_ready.clear()
        self.load = None
        self.accepted.requests.clear()
        self.metrics.forget_engine()
        if self.proc is not None:
            if self.proc.is_alive():  # it must not hold the pool (or write into it) any longer
                self.proc.kill()
            self.proc.join(timeout=5.0)
        if self.client is not None:
            self.client.conn.close()
        for hook in self.on_engine_lost:
            hook()

    def _on_event(self, ev: Event) -> None:
        handler = self.event_handlers.get(type(ev))
        if handler is not None:
            handler(ev)

    def _on_load(self, ev: Load) -> None:
        self.load = ev.snapshot
        self.accepted.requests.clear()  # taken after the engine handled them: it counts them itself
        self.metrics.observe_load(self.load)

    def _on_stopping(self, ev: Stopping) -> None:
        log.warning("engine stopping", extra={"role": self.cfg.role, "pod": self.cfg.pod_name, "reason": ev.reason})
        self.engine_ready.clear()  # not ready until its successor says Ready

    def _on_ready(self, ev: Ready) -> None:
        self.agent = ev.agent
        self.engine_ready.set()
        self.ever_ready = True
        took = round(time.monotonic() - self.engine_started_at, 1)
        self.metrics.observe_start(ev.start_phases, time.monotonic() - self.engine_started_at)
        extra = {"role": self.cfg.role, "pod": self.cfg.pod_name, "start_s": took}
        if self.restarting:
            self.restarting = False
            log.warning("engine restarted", extra={**extra, "restarts": self.restarts})
        else:
            log.info("engine ready", extra=extra)

    def observe_finish(self, reason: str | None) -> None:
        if reason:
            self.metrics.requests.labels(outcome=reason).inc()

    async def stop_engine(self, timeout: float = 10.0) -> None:
        if self.client is not None and self.alive:
            try:
                await self.client.call(Stop(), timeout=timeout)
            except Exception:
                pass
        if self.proc is not None:
            self.proc.join(timeout=timeout)
            if self.proc.is_alive():
                self.proc.kill()

    def queue_full(self) -> bool:
        """The engine's waiting queue (last snapshot) is as long as its running batch can be."""
        load = self.load
        return load is not None and load.waiting_requests >= max(1, self.cfg.runner.max_running)

    def max_request_tokens(self, total_pages: int) -> int:
        """The most KV tokens one request may reserve here: its share of the pool (0 while the pool is unknown)."""
        return int(total_pages * self.cfg.runner.page_size * self.cfg.max_request_kv_share)

    def snapshot(self) -> LoadSnapshot:
        """The engine's latest load, plus what it accepted since (``AcceptedWork``)."""
        # A dead engine's last snapshot is not reported, even in the moment before keep_engine forgets it.
        load = self.load if self.alive else None
        base = (
            self.accepted.onto(load)
            if load is not None
            else LoadSnapshot(
                role=self.cfg.role,
                pod=self.cfg.pod_name,
                queued_prefill_tokens=0,  # type: ignore[arg-type]
                running_requests=0,
                waiting_requests=0,
                free_pages=0,
                total_pages=0,
                page_size=self.cfg.runner.page_size,
                ready=False,
            )
        )
        return replace(
            base,
            ready=self.ready,
            draining=self.draining,
            max_running=self.cfg.runner.max_running,
            live_requests=len(self.requests),
            prompt_tokens_accepted=self.prompt_tokens_accepted,
            decodes_accepted=self.decodes_accepted,
            max_request_tokens=self.max_request_tokens(base.total_pages),
        )
