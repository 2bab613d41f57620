"""The router's front door, as plain ASGI before FastAPI parses anything: bearer auth (before the body is read),
and outside it the count of every response. Without an API key the operator routes (``/router/``, ``/debug/``)
answer only loopback clients (403 otherwise): they show what one client must not learn about the others.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import OpenAIError, operator_only, unauthorized
from router.metrics import RouterMetrics

__all__ = ["COUNTED", "GENERATION_ROUTES", "FrontDoor", "ResponseCounter"]

_PROTECTED = ("/v1/", "/router/", "/debug/", "/tokenize", "/detokenize")  # /health, /ready, /metrics stay open
_OPERATOR = ("/router/", "/debug/")  # without an API key: loopback clients only
_LOOPBACK = ("127.", "::1", "::ffff:127.")


async def _send_error(send: Send, err: OpenAIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class FrontDoor:
    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        if self.expected is None and scope["path"].startswith(_OPERATOR) and not _from_loopback(scope):
            await _send_error(send, operator_only())
            return
        if self.expected is not None and scope["path"].startswith(_PROTECTED):
            given = next((v for k, v in headers if k == b"authorization"), b"")
            scheme, _, token = given.strip().partition(b" ")
            # The scheme is case-insensitive (RFC 9110 11.1); the key is compared in constant time.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
                await _send_error(send, unauthorized())
                return
        await self.app(scope, receive, send)


def _from_loopback(scope: Scope) -> bool:
    client = scope.get("client")
    return client is not None and str(client[0]).startswith(_LOOPBACK)


GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
COUNTED = "kvferry_counted"  # request-state key: a request record counts this request (router/timeline.py)
CLIENT_GONE = 499  # the status counted for a request whose client left before any response started


class ResponseCounter:
    """Counts every HTTP response by method, route template (paths would grow the label set) and status, and
    counts generation requests refused before a request record took them."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics, static_paths: Callable[[], Iterable[str]]) -> None:
        self.app = app
        self.metrics = metrics
        self._static_paths = static_paths  # routes without parameters: named even when refused before routing
        self._known: frozenset[str] | None = None

    def _template(self, scope: Scope) -> str:
        route = getattr(scope.get("route"), "path", None)
        if route:
            return str(route)
        if self._known is None:
            self._known = frozenset(self._static_paths())
        return scope["path"] if scope["path"] in self._known else "unmatched"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = CLIENT_GONE
        request_state = scope.setdefault("state", {})

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            m = self.metrics
            m.http_requests.labels(method=scope["method"], route=self._template(scope), status=str(status)).inc()
            if scope["path"] in GENERATION_ROUTES and scope["method"] == "POST" and not request_state.get(COUNTED):
                outcome = "rejected" if status >= 400 else "ok"
                m.requests.labels(status=str(status), outcome=outcome).inc()
