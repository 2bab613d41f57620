"""A worker's control plane, assembled: the FastAPI app over its engine (``create_app``) and the server that
drains on SIGTERM (``serve_worker``). Its parts: the engine's state (worker_state.py), its supervision
(supervision.py), the probes (probes.py), metrics (worker_metrics.py) and error answers (http_errors.py);
what every role answers the same way is here, the role's own routes come from its plug-ins (roles.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.config import WorkerConfig
from common.gc_pauses import watch_collector
from common.http_guard import RequestLimits
from common.http_server import server_options
from common.log import limit_tracebacks
from common.loop_watchdog import LoopWatchdog
from common.observability.tracing import init_tracing
from common.protocol import AbortRequest
from common.settings import HttpLimits
from common.worker.channel import EngineError
from common.worker.engine_entry import engine_process
from common.worker.http_errors import ENGINE_ERROR_STATUS, BadMessage, error_response, read_message, validation_message
from common.worker.messages import Abort
from common.worker.probes import ProbeFront
from common.worker.roles import plugins
from common.worker.supervision import keep_engine
from common.worker.worker_state import WorkerState

log = logging.getLogger("kvferry.control")


def create_app(
    role: str, cfg: WorkerConfig | None = None, http_limits: HttpLimits | None = None, freeze_gc: bool = False
) -> FastAPI:
    """The worker app of ``role`` (common/worker/roles.py): its plug-ins' engine parts and routes over one engine.
    ``cfg`` defaults to ``WorkerConfig.from_env(role)``, ``http_limits`` to ``HttpLimits.from_env()``;
    ``freeze_gc``: the serving process's own app (common/worker/main.py), whose startup objects live as long as
    it does."""
    parts = plugins(role)
    state = WorkerState(cfg or WorkerConfig.from_env(role), engine_process, tuple(p.engine for p in parts))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start_engine()
        watch = asyncio.create_task(keep_engine(state))
        watchdog = LoopWatchdog()  # stacks only: the engine process and the pod's probes handle the rest
        watchdog.start()
        try:
            # A collection here holds every stream this worker relays at once: its pauses are measured (and its
            # startup objects frozen out of the walks) as in the engine process and the router.
            async with watch_collector(state.metrics.http_gc_pause.observe, freeze_gc):
                yield
        finally:
            watch.cancel()
            await watchdog.stop()
            await state.relay_lag.stop()
            await state.stop_engine()

    limit_tracebacks()  # a 500's traceback at most once a minute per failure (common/log.py)
    init_tracing(f"kvferry-{state.cfg.role}")  # off unless an OTLP endpoint is set (common/observability/tracing.py)
    app = FastAPI(title=f"kvferry {state.cfg.role} worker", lifespan=lifespan)
    app.state.worker = state

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, validation_message(exc.errors()))

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

    @app.post("/internal/abort")
    async def abort(request: Request) -> Response:
        """Stops a request, whichever role holds it; 204 whether or not it was here."""
        ab = await read_message(request, AbortRequest)
        live = state.requests.get(ab.req_id)
        if live is not None:
            live.called_off = True
        if state.client is not None:  # no engine yet: nothing to stop
            state.client.cast(Abort(ab.req_id))
        return Response(status_code=204)

    for part in parts:
        part.add_routes(app, state)
    return app


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
