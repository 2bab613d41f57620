"""The request side of the HTTP limits (common/settings.py HttpLimits), as plain ASGI ahead of the app.

uvicorn's protocol (common/http_server.py) bounds what a request head may cost while it arrives; this guard
checks the parsed request exactly: the target's length (414), the headers' count and size (431) and the body
(413, declared or streamed). The body is read here, bounded, and replayed, so the app never sees half of an
oversized body. Errors are OpenAI-shaped, like every other error of the router and the workers.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.settings import HttpLimits

__all__ = ["LimitError", "RequestLimits", "error_body", "limit_error", "malformed_request", "transfer_coding_error"]

# Per header line beyond name and value: ": " and CRLF, as sent on the wire.
HEADER_LINE_OVERHEAD = 4


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class LimitError:
    """A refusal for crossing one HTTP limit (or of a request that is not HTTP we serve): status, OpenAI error
    body, and the JSON bytes."""

    def __init__(self, status: int, message: str, code: str, type_: str = "invalid_request_error") -> None:
        self.status = status
        self.body = error_body(message, type_, None, code)
        self.payload = json.dumps(self.body).encode()


# Each limit's refusal: status, message (formatted with the limit's value) and error code.
_REFUSALS: dict[str, tuple[int, str, str]] = {
    "max_url_bytes": (414, "The request URL is longer than {} bytes.", "url_too_long"),
    "max_header_bytes": (
        431,
        "The request headers are larger than {} bytes in all.",
        "request_header_fields_too_large",
    ),
    "max_header_count": (431, "The request has more than {} headers.", "request_header_fields_too_large"),
    "max_body_bytes": (413, "Request body is larger than {} bytes.", "request_too_large"),
    "header_timeout_s": (408, "The request headers did not arrive within {:g} s.", "request_timeout"),
    "body_timeout_s": (408, "The request body did not arrive within {:g} s.", "request_timeout"),
    "max_connections": (503, "The server has {} connections open, its limit; retry shortly.", "service_unavailable"),
}


def limit_error(name: str, limits: HttpLimits) -> LimitError:
    """The refusal for the limit ``name`` (a field of HttpLimits), naming the limit and its value."""
    status, message, code = _REFUSALS[name]
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return LimitError(status, message.format(getattr(limits, name)), code, type_)


def malformed_request() -> LimitError:
    """The refusal of bytes the HTTP/1.1 parser cannot read as a request (bad framing, not HTTP at all)."""
    return LimitError(400, "The request is not valid HTTP/1.1.", "invalid_http_request")


def transfer_coding_error(values: list[bytes]) -> LimitError | None:
    """The refusal of a request's ``Transfer-Encoding`` header values, if they are not plain ``chunked``.

    RFC 9112: when chunked is not the final coding (or is applied twice) the body's length cannot be known,
    which a server MUST answer 400 (section 6.3); a coding it does not implement (gzip, chunked) SHOULD be
    501 (section 6.1). Either way the body cannot be read, so the connection is closed after the answer."""
    codings = [c.strip().lower() for v in values for c in v.split(b",") if c.strip()]
    if not values or codings == [b"chunked"]:
        return None
    shown = ", ".join(c.decode("latin-1") for c in codings)
    if not codings or codings[-1] != b"chunked" or codings.count(b"chunked") > 1:
        return LimitError(
            400,
            f"Transfer-Encoding {shown!r} does not end in a single chunked: the body's length cannot be known.",
            "invalid_transfer_encoding",
        )
    return LimitError(
        501,
        f"Transfer-Encoding {shown!r} is not supported: send the body as plain chunked or with Content-Length.",
        "unsupported_transfer_encoding",
    )


def head_error(scope: Scope, limits: HttpLimits) -> LimitError | None:
    """The limit a parsed request head crosses, if any."""
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    if target > limits.max_url_bytes:
        return limit_error("max_url_bytes", limits)
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    if len(headers) > limits.max_header_count:
        return limit_error("max_header_count", limits)
    if sum(len(k) + len(v) + HEADER_LINE_OVERHEAD for k, v in headers) > limits.max_header_bytes:
        return limit_error("max_header_bytes", limits)
    return None


async def send_error(send: Send, err: LimitError) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(err.payload)).encode())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": err.payload, "more_body": False})


class RequestLimits:
    """ASGI middleware: 414/431 for a request head over the limits, 413 for a body over them."""

    def __init__(self, app: ASGIApp, limits: HttpLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        err = head_error(scope, self.limits)
        if err is not None:
            await send_error(send, err)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await send_error(send, limit_error("max_body_bytes", self.limits))
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
            if size > limit:
                await send_error(send, limit_error("max_body_bytes", self.limits))
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
