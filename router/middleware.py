"""The router's front door, as plain ASGI (before FastAPI parses anything): bearer auth and body size.

Both checks run before the body is parsed, so an unauthenticated or oversized request costs neither
JSON parsing nor validation, and gets its 401/413 whatever its body looks like.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import OpenAIError, too_large, unauthorized

__all__ = ["FrontDoor"]

_PROTECTED = ("/v1/", "/router/", "/debug/", "/tokenize", "/detokenize")  # /health, /ready, /metrics stay open


async def _send_error(send: Send, err: OpenAIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class FrontDoor:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        if self.expected is not None and scope["path"].startswith(_PROTECTED):
            given = next((v for k, v in headers if k == b"authorization"), b"")
            scheme, _, token = given.strip().partition(b" ")
            # The scheme is case-insensitive (RFC 9110 11.1); the key itself is compared in constant time.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
                await _send_error(send, unauthorized())
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in headers if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_error(send, too_large(self.max_body_bytes))
            return
        # Read the body here (bounded) and replay it: a chunked upload without Content-Length cannot
        # exceed the limit either, and the app never sees a half-read body.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(send, too_large(self.max_body_bytes))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            # After the body: the real channel, which is where a client's disconnect shows up.
            msg: dict[str, Any] = await receive()
            return msg

        await self.app(scope, replay, send)
