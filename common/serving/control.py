"""What both workers' control planes share: the engine process, health/readiness, load, metrics, drain.

Busy is not dead: ``/health``, ``/ready`` and ``/load`` are answered by this process (the engine is a
separate one) from its last engine snapshot (pushed every 0.1 s between steps), by a plain-ASGI front
(``ProbeFront``) ahead of FastAPI's routing, so neither a long engine step nor a busy request path delays them.
Busy does not look idle either: a snapshot is only as new as the engine's last step, and a long prompt's step
on a CPU takes seconds, so what the engine accepted since its last snapshot (``AcceptedWork``) is added to it
(requests, prompt tokens to prefill, pages) until the next snapshot, which counts them itself, arrives.

An engine process that dies after it was ready (kill -9, the OOM killer, a crash) is seen within 0.1 s (its
process is gone or its pipe closed) and started again by this process (``keep_engine``): meanwhile the worker
answers ``/ready`` 503 and ``/load`` without the dead engine's numbers, its streams end with a retryable error
(the router continues them elsewhere), and ``/health`` stays 200 so a kubelet leaves the pod alone. An engine
that cannot be restarted (``KVFERRY_ENGINE_RESTARTS`` failed starts in a row) makes the worker exit non-zero,
as one that fails its first start does, and the supervisor (kubelet, ``kvferry up``) restarts the worker.

A decode worker whose engine queue is full (as many requests waiting as it can run at once: each new one
would wait a whole batch's lifetime) refuses new generate requests with 429 + Retry-After, which the
router turns into a retry on another worker or a 429 to its client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from common.config import WorkerConfig
from common.http_guard import RequestLimits
from common.http_server import server_options
from common.internal_auth import INTERNAL_PREFIX
from common.log import limit_tracebacks
from common.observability.tracing import init_tracing
from common.protocol import LoadSnapshot
from common.serving.channel import EngineClient, EngineError
from common.serving.engine_metrics import EngineMetrics
from common.serving.messages import AgentInfo, Event, KVIntegrity, Load, Ready, Steps, Stop
from common.settings import HttpLimits

log = logging.getLogger("kvferry.control")


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI-shaped error body; workers and router answer errors the same way."""
    return JSONResponse(_error_body(message, type_, code), status_code=status, headers=headers)


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
        self.host_moves = Counter(
            "kvferry_host_kv_pages_moved_total",
            "Host KV tier: pages copied out of the device pool (saved) or back into it (loaded)",
            ["direction"],
            registry=r,
        )
        self._host_moved = {"saved": 0, "loaded": 0}
        self.requests = Counter("kvferry_requests_total", "Finished requests by outcome", ["outcome"], registry=r)
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
        # Latency and transfer histograms (common/serving/engine_metrics.py).
        self.engine = EngineMetrics(r, gpu=self.gpu)

    def forget_engine(self) -> None:
        """The engine died: its pool and queues are gone with it, so the gauges read zero until the next one
        reports (a dead engine's last numbers would say pages are free that no process holds)."""
        for g in (self.queued, self.running, self.waiting, self.free, self.total, self.usage, self.host_cached):
            g.set(0)
        self.host_total.set(0)
        self._host_moved = {"saved": 0, "loaded": 0}  # the next engine counts from zero

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
        for direction, now in (("saved", load.host_pages_saved), ("loaded", load.host_pages_loaded)):
            if now > self._host_moved[direction]:  # cumulative in the engine: count the increase
                self.host_moves.labels(direction=direction).inc(now - self._host_moved[direction])
                self._host_moved[direction] = now


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
        return load.model_copy(
            update={
                "running_requests": load.running_requests + len(self.requests),
                "queued_prefill_tokens": load.queued_prefill_tokens + tokens,
                "free_pages": max(0, load.free_pages - pages),
            }
        )


class WorkerState:
    """The control plane's view of its engine process."""

    def __init__(self, cfg: WorkerConfig, host_target: Callable[..., None], roles: tuple[type, ...]) -> None:
        self.cfg = cfg
        self.host_target = host_target
        self.roles = roles  # the engine's (common/serving/engine_host.py EngineRole), built in its process
        self.metrics = WorkerMetrics(gpu=cfg.runner.device.startswith("cuda"))
        self.engine_ready = asyncio.Event()
        self.agent: AgentInfo | None = None  # the engine's, from its Ready event
        self.load: LoadSnapshot | None = None
        self.accepted = AcceptedWork(cfg.runner.page_size)  # what the engine took in since `load` was taken
        self.draining = False
        # Request ids with an open stream here (generate or prefill), from arrival until the stream ends however
        # it ends; reported as ``live_requests`` in /load, which the router reconciles its own counts with.
        self.live: set[str] = set()
        self.proc: mp.process.BaseProcess | None = None
        self.client: EngineClient | None = None
        # The engine's events by type; a role's routes add theirs.
        self.event_handlers: dict[type, Callable[[Any], None]] = {
            Ready: self._on_ready,
            Load: self._on_load,
            Steps: lambda ev: self.metrics.engine.observe_steps(ev.decode),
            KVIntegrity: lambda ev: self.metrics.kv_integrity_violations.inc(ev.violations),
        }
        # Called when the engine died and before its successor starts (routes drop what they knew of it).
        self.on_engine_lost: list[Callable[[], None]] = []
        self.engine_started_at = 0.0  # time.monotonic() of the latest engine start
        self.restarts = 0  # engines started after the first
        self.restarting = False  # the engine died and its successor is not ready yet
        self.ever_ready = False  # an engine was ready once: one that dies now is restarted, not fatal

    @property
    def ready(self) -> bool:
        # Its first load snapshot in as well: a worker never says ready beside a /load of 0 pages.
        return self.engine_ready.is_set() and self.load is not None and not self.draining and self.alive

    @property
    def inflight(self) -> int:
        return len(self.live)

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
            args=(self.roles, self.cfg, theirs),
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
        self.load = LoadSnapshot.model_validate(ev.snapshot)
        self.accepted.requests.clear()  # taken after the engine handled them: it counts them itself
        self.metrics.observe_load(self.load)

    def _on_ready(self, ev: Ready) -> None:
        self.agent = ev.agent
        self.engine_ready.set()
        self.ever_ready = True
        took = round(time.monotonic() - self.engine_started_at, 1)
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
        update = {
            "ready": self.ready,
            "draining": self.draining,
            "max_running": self.cfg.runner.max_running,
            "live_requests": len(self.live),
        }
        return base.model_copy(update=update)


def create_worker_app(
    state: WorkerState,
    add_routes: Callable[[FastAPI, WorkerState], None],
    http_limits: HttpLimits | None = None,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start_engine()
        watch = asyncio.create_task(keep_engine(state))
        try:
            yield
        finally:
            watch.cancel()
            await state.stop_engine()

    limit_tracebacks()  # a 500's traceback at most once a minute per failure (common/log.py)
    init_tracing(f"kvferry-{state.cfg.role}")  # off unless an OTLP endpoint is set (common/observability/tracing.py)
    app = FastAPI(title=f"kvferry {state.cfg.role} worker", lifespan=lifespan)
    app.state.worker = state

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _validation_message(exc.errors()))

    @app.exception_handler(BadMessage)
    async def _bad_message(request: Request, exc: BadMessage) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        status = ENGINE_ERROR_STATUS.get(exc.code, 503)
        return error_response(status, str(exc), "invalid_request_error" if status < 500 else "unavailable", exc.code)

    # ProbeFront (probes, the internal token, a full queue) answers first, then the HTTP limits
    # (common/settings.py HttpLimits: the body is read there, after the token check), then FastAPI.
    app.state.http_limits = limits = http_limits or HttpLimits.from_env()
    app.add_middleware(RequestLimits, limits=replace(limits, max_body_bytes=limits.max_internal_body_bytes))
    app.add_middleware(ProbeFront, state=state)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        if state.proc is not None and not state.alive:
            state.metrics.forget_engine()  # before keep_engine notices: none of the dead engine's gauges
        else:
            state.metrics.observe_load(state.snapshot())  # the gauges count work accepted since the last snapshot
        return PlainTextResponse(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_routes(app, state)
    return app


RETRY_AFTER_S = 1
ENGINE_START_FAILED_EXIT = 3


ENGINE_RESTART_FAILED_EXIT = 4
ENGINE_WATCH_S = 0.1
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0)  # before the 1st, 2nd, ... start in a row that failed


def _exit_worker(code: int) -> None:
    for logger in (logging.getLogger(), logging.getLogger("kvferry")):
        for handler in logger.handlers:
            handler.flush()
    os._exit(code)


async def keep_engine(state: WorkerState) -> None:
    """Watches the engine process and starts it again when it dies after it was ready.

    An engine that exits before its first ready (bad model path, out of device memory, a CUDA error in graph
    capture) would fail again: the worker exits non-zero at once, with the cause in the log (the engine
    logged its traceback), so a supervisor or Kubernetes sees a failed start. One that dies later (kill -9,
    the OOM killer) is started again at once; a restart that dies before it is ready, or is not ready within
    ``engine_start_timeout_s``, is retried after a back-off, and after ``engine_restarts`` such failures in a
    row the worker exits non-zero for its supervisor to restart it."""
    cfg = state.cfg
    failed = 0  # restarts in a row that died before they were ready
    while True:
        await asyncio.sleep(ENGINE_WATCH_S)
        if state.alive:
            if state.engine_ready.is_set():
                failed = 0
            elif state.restarting and time.monotonic() - state.engine_started_at > cfg.engine_start_timeout_s:
                log.error("restarted engine not ready in time; killing it", extra={"role": cfg.role})
                assert state.proc is not None
                state.proc.kill()
            continue
        if state.draining or state.proc is None:
            continue  # shutting down: the engine stops with the worker
        exitcode = state.proc.exitcode
        if not state.ever_ready:
            log.error(
                "engine process exited before it was ready; the worker exits",
                extra={"role": cfg.role, "exitcode": exitcode},
            )
            _exit_worker(ENGINE_START_FAILED_EXIT)
        if state.restarting:
            failed += 1
        if failed >= cfg.engine_restarts:
            log.error(
                "engine could not be restarted; the worker exits",
                extra={"role": cfg.role, "pod": cfg.pod_name, "failed_starts": failed, "exitcode": exitcode},
            )
            _exit_worker(ENGINE_RESTART_FAILED_EXIT)
        delay = RESTART_BACKOFF_S[min(failed, len(RESTART_BACKOFF_S) - 1)]
        if state.client is not None and not state.client.closed.is_set():
            state.proc.kill()  # a pipe still open: the reader ends its streams once the process is gone
            try:
                async with asyncio.timeout(5.0):
                    await state.client.closed.wait()
            except TimeoutError:
                pass
        state.forget_engine()
        state.restarting = True
        state.restarts += 1
        state.metrics.engine_restarts.inc()
        log.warning(
            "engine process died; restarting it",
            extra={
                "role": cfg.role,
                "pod": cfg.pod_name,
                "exitcode": exitcode,
                "restart": state.restarts,
                "delay_s": delay,
            },
        )
        if delay:
            await asyncio.sleep(delay)
        if not state.draining:
            state.start_engine()


def _probe_answer(state: WorkerState, path: str) -> tuple[int, dict[str, Any]] | None:
    if path == "/health":
        # A dead engine is restarted by this process (keep_engine), or the worker exits: either way the
        # process answering here is not one for a liveness probe to restart.
        if state.restarting or (state.ever_ready and not state.alive):
            return 200, {"status": "restarting", "restarts": state.restarts}
        if state.proc is not None and not state.alive:
            return 503, _error_body("engine process is not running", "unavailable", "engine_down")
        return 200, {"status": "ok"}
    if path == "/ready":
        if not state.ready:
            why = "draining" if state.draining else "engine restarting" if state.restarting else "engine not ready"
            return 503, _error_body(why, "unavailable", "not_ready")
        return 200, {"status": "ready"}
    if path == "/load":
        return 200, state.snapshot().model_dump()
    return None


def _error_body(message: str, type_: str, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


class ProbeFront:
    """Plain ASGI in front of the worker app: refuses ``/internal/*`` without the internal token (401, when one
    is set: common/internal_auth.py), answers ``GET /health|/ready|/load`` from the control plane's own state,
    and refuses ``POST /internal/generate`` with 429 while the engine queue is full."""

    def __init__(self, app: ASGIApp, state: WorkerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers: list[tuple[bytes, bytes]] = []
            answer = self._unauthorized(scope, headers)  # refused before the body is read: nothing changes
            if answer is None and scope["method"] == "GET":
                answer = _probe_answer(self.state, scope["path"])
            elif answer is None and scope["path"] == "/internal/generate" and self.state.queue_full():
                message = "the engine queue is full; retry shortly or on another worker"
                answer = 429, _error_body(message, "rate_limit_error", "queue_full")
                headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
            if answer is not None:
                status, obj = answer
                body = json.dumps(obj).encode()
                headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    def _unauthorized(self, scope: Scope, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict[str, Any]] | None:
        token = self.state.cfg.internal_token
        if not token.required or not scope["path"].startswith(INTERNAL_PREFIX):
            return None
        if token.accepts(next((v for k, v in scope.get("headers", []) if k == b"authorization"), None)):
            return None
        headers.append((b"www-authenticate", b"Bearer"))
        message = "the internal API needs this deployment's token (Authorization: Bearer; KVFERRY_INTERNAL_TOKEN)"
        return 401, _error_body(message, "authentication_error", "invalid_internal_token")


def _validation_message(errors: Any) -> str:
    parts = []
    for e in list(errors)[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


class BadMessage(ValueError):
    """A malformed internal protocol message (answered with 400)."""


async def read_message(request: Request, model: type) -> Any:
    """Parses and validates an internal protocol message (version included) from a request body."""
    try:
        return model.model_validate(json.loads(await request.body()))
    except ValidationError as e:
        raise BadMessage(_validation_message(e.errors())) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadMessage(f"body is not valid JSON: {e}") from None
    except RecursionError:  # json.loads on deeply nested arrays/objects
        raise BadMessage("body is not valid JSON: nested too deeply") from None


# Engine error codes -> HTTP status, for both workers.
# engine_timeout: the engine may still run the command, so never a refusal status (a prefill peer that answered
# 503 registered nothing; this one may have).
ENGINE_ERROR_STATUS = {
    "unknown_peer": 409,
    "layout_mismatch": 400,
    "invalid_request": 400,
    "queue_full": 429,
    "engine_timeout": 504,
    # The id is live on this worker already: a resent delivery of the same request (router/upstream.py
    # retries under a new id) or a caller's bug; either way not this body's fault, hence not 400.
    "duplicate_request": 409,
    # A prefill for a request its decode worker had already cancelled (prefill_worker/engine.py): refused, nothing registered.
    "cancelled": 410,
}


class DrainingServer(uvicorn.Server):
    """uvicorn that, on the first SIGTERM/SIGINT, leaves readiness, lets in-flight requests finish for up to
    `drain_seconds`, and only then shuts down; a second signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: WorkerState) -> None:
        super().__init__(config)
        self.worker_state = state
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.worker_state.draining or sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)
        self.worker_state.draining = True
        log.info("draining", extra={"inflight": self.worker_state.inflight})
        self._drain_task = asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.worker_state.cfg.drain_seconds
        while self.worker_state.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


def serve_worker(app: FastAPI, state: WorkerState) -> int:
    cfg = state.cfg
    options = server_options(app.state.http_limits)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, timeout_graceful_shutdown=5, **options)
    DrainingServer(config, state).run()
    return 0
