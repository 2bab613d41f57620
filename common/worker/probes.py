"""The probes and the front door of a worker's HTTP server (``ProbeFront``).

Busy is not dead: ``/health``, ``/ready`` and ``/load`` are answered by the control plane (the engine is a
separate process) from its last engine snapshot (pushed every 0.1 s between steps), by a plain-ASGI front
ahead of FastAPI's routing, so neither a long engine step nor a busy request path delays them.

A decode worker whose engine queue is full (as many requests waiting as it can run at once: each new one
would wait a whole batch's lifetime) refuses new generate requests with 429 + Retry-After, which the
router turns into a retry on another worker or a 429 to its client.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from common.internal_auth import INTERNAL_PREFIX
from common.protocol import to_builtins
from common.worker.http_errors import error_body
from common.worker.worker_state import WorkerState

RETRY_AFTER_S = 1


def _probe_answer(state: WorkerState, path: str) -> tuple[int, dict[str, Any]] | None:
    if path == "/health":
        # A dead engine is restarted by this process (keep_engine), or the worker exits: either way the
        # process answering here is not one for a liveness probe to restart.
        if state.restarting or (state.ever_ready and not state.alive):
            return 200, {"status": "restarting", "restarts": state.restarts}
        if state.proc is not None and not state.alive:
            return 503, error_body("engine process is not running", "unavailable", "engine_down")
        return 200, {"status": "ok"}
    if path == "/ready":
        if not state.ready:
            why = "draining" if state.draining else "engine restarting" if state.restarting else "engine not ready"
            return 503, error_body(why, "unavailable", "not_ready")
        return 200, {"status": "ready"}
    if path == "/load":
        return 200, to_builtins(state.snapshot())
    return None


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
                answer = 429, error_body(message, "rate_limit_error", "queue_full")
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
        return 401, error_body(message, "authentication_error", "invalid_internal_token")
