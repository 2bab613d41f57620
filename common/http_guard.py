"""The request side of the HTTP limits, as plain ASGI ahead of the app (docs/reliability.md, "HTTP limits"): the
parsed target (414), headers (431) and body (413), read bounded and replayed so the app never sees half of one.
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
    return {"error": {"message": _encodable(message), "type": type_, "param": _encodable(param), "code": code}}


def _encodable(text: str | None) -> str | None:
    """The text with lone surrogates escaped: JSON may carry them (a model name, a dict key) and an error that
    quotes one back must still encode as UTF-8."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class LimitError:
    """A refusal for crossing one HTTP limit (or for bytes that are not HTTP we serve), with its JSON body."""

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
    status, message, code = _REFUSALS[name]
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return LimitError(status, message.format(getattr(limits, name)), code, type_)


def malformed_request() -> LimitError:
    """The refusal of bytes the HTTP/1.1 parser cannot read as a request."""
    return LimitError(400, "The request is not valid HTTP/1.1.", "invalid_http_request")


def transfer_coding_error(values: list[bytes]) -> LimitError | None:
    """The refusal of ``Transfer-Encoding`` values other than plain ``chunked``: 400 when the body's length cannot be
    known (RFC 9112 6.3), 501 for a coding not implemented (6.1); the connection closes after either."""
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
        # Read here (bounded) and replayed: a chunked upload cannot exceed the limit, the app never sees half a body.
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
            # After the body: the real channel, where a client's disconnect shows up.
            msg: dict[str, Any] = await receive()
            return msg

        await self.app(scope, replay, send)
