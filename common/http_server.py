"""uvicorn with the HTTP limits (common/settings.py HttpLimits) for the router and the workers' control planes
(docs/reliability.md, "HTTP limits").

uvicorn bounds neither a request head's size nor its arrival time, and httptools joins a header's pieces as
they come (a 128 MB header held the loop for ~20 s): these protocols count a head's bytes as they arrive and
refuse it past the limits, time out slow heads, bodies and stalled writes, and answer parser errors in
OpenAI's JSON shape. The per-request checks are common/http_guard.py's.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from common.http_guard import LimitError, limit_error, malformed_request, transfer_coding_error
from common.settings import HttpLimits

__all__ = ["REFUSAL_HOOK", "LimitedH11Protocol", "protocol_class", "server_options"]

# The request line beyond its target: method, spaces, "HTTP/1.1" and the line end.
_REQUEST_LINE_SLACK = 64
# How long a refused connection's further bytes are read (and dropped) before it is closed.
_LINGER_S = 2.0
# h11 refuses (400) a head larger than this itself: above ours and one read (256 KiB), so ours answers first.
_H11_SLACK = 512 * 1024


def _raw_response(err: LimitError) -> bytes:
    body = err.payload
    head = (
        f"HTTP/1.1 {err.status} {_REASONS[err.status]}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


_REASONS = {
    400: "Bad Request",
    408: "Request Timeout",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    501: "Not Implemented",
    503: "Service Unavailable",
}


class _Refused(Exception):
    """Stops the parser: uvicorn answers any parser error with ``send_400_response``, which sends ``_pending``."""


def _transfer_codings(head: bytes) -> list[bytes]:
    values = []
    for line in head.split(b"\r\n\r\n", 1)[0].split(b"\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"transfer-encoding":
            values.append(value.strip())
    return values


# The app ``state`` attribute called with each status answered here before the app saw the request (router/app.py).
REFUSAL_HOOK = "http_refused"


def _refusal_hook(app: Any) -> Any:
    """``app.state.http_refused`` of the app uvicorn serves, under its wrappers."""
    for _ in range(8):
        hook = getattr(getattr(app, "state", None), REFUSAL_HOOK, None)
        if hook is not None:
            return hook
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


class _Limited:
    """Head-size cap and head/body deadlines, mixed in ahead of one of uvicorn's HTTP/1.1 protocols. Phase:
    ``head`` (header deadline), ``body`` (body deadline) or ``idle`` (uvicorn's keep-alive timer)."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any
    connections: set[Any]
    tasks: set[Any]

    def _init_limits(self, limits: HttpLimits) -> None:
        self.limits = limits
        self._phase = "idle"
        self._head_bytes = 0
        self._line_done = False  # the request line's end has arrived
        self._head_cap = limits.max_url_bytes + limits.max_header_bytes + _REQUEST_LINE_SLACK
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False
        self._pending: LimitError | None = None  # a refusal decided inside the parser (see _Refused)
        self._head = bytearray()
        self._write_stall: asyncio.TimerHandle | None = None  # armed while writing is paused

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        # A connection that never sends a byte is held to the header deadline too.
        self._begin_head()

    def shutdown(self) -> None:
        """Server shutdown: a refused connection is just closed (uvicorn's shutdown does not expect its state)."""
        if self._refused:
            self._close()
        else:
            super().shutdown()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._cancel_write_stall()
        super().connection_lost(exc)  # type: ignore[misc]

    # Whether the next head begins with the bytes after a message (h11) or at `on_message_begin` (httptools).
    _head_starts_on_data = True

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._phase == "idle" and self._head_starts_on_data:
            self._begin_head()
        if self._phase == "head":
            if not self._line_done:
                end = data.find(b"\n")
                if self._head_bytes + (len(data) if end < 0 else end) > self.limits.max_url_bytes + _REQUEST_LINE_SLACK:
                    # Before the parser sees it: httptools refuses a request line over 64 KiB itself.
                    self._refuse(limit_error("max_url_bytes", self.limits))
                    return
                self._line_done = end >= 0
            self._head_bytes += len(data)
            self._keep_head(data)
        super().data_received(data)  # type: ignore[misc]
        if self._phase != "head" or self._refused or self.transport.is_closing():
            return
        if not self._line_done and self._head_bytes > self.limits.max_url_bytes + _REQUEST_LINE_SLACK:
            self._refuse(limit_error("max_url_bytes", self.limits))
        elif self._head_bytes > self._head_cap:
            self._refuse(limit_error("max_header_bytes", self.limits))

    def _keep_head(self, data: bytes) -> None:
        """The head's bytes as they arrive (bounded by the cap): the parsers report no headers with their errors."""
        if data:
            self._head += data
        else:
            self._head = bytearray()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a parser error: the refusal a check set aside, else the parser's verdict, as JSON."""
        err, self._pending = self._pending or self._parser_refusal(), None
        self._refuse(err)

    def _parser_refusal(self) -> LimitError:
        # The parsers refuse some transfer codings without saying which: RFC 9112 answers 400 or 501 by the head.
        if self._phase == "head":
            err = transfer_coding_error(self._transfer_codings())
            if err is not None:
                return err
        return malformed_request()

    def _transfer_codings(self) -> list[bytes]:
        return _transfer_codings(bytes(self._head))

    def _head_refusal(self, headers: list[tuple[bytes, bytes]]) -> LimitError | None:
        """Why a parsed head is refused before any app sees it: a transfer coding other than plain chunked, or a
        connection past the cap (uvicorn's own plain-text check is off)."""
        err = transfer_coding_error([v for k, v in headers if k.lower() == b"transfer-encoding"])
        if err is not None:
            return err
        cap = self.limits.max_connections
        if cap and (len(self.connections) >= cap or len(self.tasks) >= cap):
            return limit_error("max_connections", self.limits)
        return None

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._write_stall is None:
            self._write_stall = self.loop.call_later(self.limits.write_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        self._cancel_write_stall()  # the client took some: progress
        super().resume_writing()  # type: ignore[misc]

    def _cancel_write_stall(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None

    def _write_stalled(self) -> None:
        # A response is under way and its bytes are stuck: drop the connection (the app sees a hang-up).
        self._write_stall = None
        self._refused = True
        self._cancel_deadline()
        self.transport.abort()

    def _begin_head(self) -> None:
        self._phase = "head"
        self._head_bytes = 0
        self._keep_head(b"")
        self._line_done = False
        self._arm(self.limits.header_timeout_s, self._head_late)

    def _head_done(self) -> None:
        self._phase = "body"
        self._keep_head(b"")
        self._arm(self.limits.body_timeout_s, self._body_late)

    def _message_done(self) -> None:
        self._phase = "idle"
        self._cancel_deadline()

    def _arm(self, delay: float, callback: Any) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(delay, callback)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _responding(self) -> bool:
        """A response to an earlier request is still being sent (pipelining)."""
        return self.cycle is not None and not self.cycle.response_complete and self._phase == "head"

    def _head_late(self) -> None:
        self._deadline = None
        if self._phase != "head" or self.transport.is_closing():
            return
        if self._responding():
            # The next head waits behind a response still streaming: its clock starts after that.
            self._arm(self.limits.header_timeout_s, self._head_late)
            return
        if self._head_bytes == 0:
            self._close()  # nothing was asked: nothing to answer
        else:
            self._refuse(limit_error("header_timeout_s", self.limits))

    def _body_late(self) -> None:
        self._deadline = None
        if self._phase != "body" or self.transport.is_closing():
            return
        self._refuse(limit_error("body_timeout_s", self.limits))  # a close alone once a response has begun

    def _refuse(self, err: LimitError) -> None:
        cycle = self.cycle
        if self._phase == "head":  # ``cycle`` is the previous request's, if any
            may_answer = cycle is None or cycle.response_complete
        else:  # ``cycle`` is this request's
            may_answer = cycle is not None and not cycle.response_started
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if not may_answer or not self.transport.can_write_eof():
            self._close()
            return
        # A lingering close: closing with the client's unread bytes queued would reset the connection and can
        # destroy the answer before it is read; so answer, end our side, drop what comes, close after _LINGER_S.
        self._refused = True
        self._cancel_deadline()
        hook = _refusal_hook(getattr(self, "app", None))
        if hook is not None:
            hook(err.status)
        self.transport.write(_raw_response(err))
        self.transport.write_eof()
        self._deadline = self.loop.call_later(_LINGER_S, self._close)

    def _close(self) -> None:
        self._refused = True
        self._cancel_deadline()
        if not self.transport.is_closing():
            self.transport.close()


class LimitedH11Protocol(_Limited, H11Protocol):
    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_limits(limits)
        next_event = self.conn.next_event

        def observed() -> Any:
            event = next_event()
            if isinstance(event, h11.Request):
                self._pending = self._head_refusal(list(event.headers))
                if self._pending is not None:
                    raise h11.RemoteProtocolError("refused")  # uvicorn answers with send_400_response
                self._head_done()
            elif isinstance(event, h11.EndOfMessage):
                self._message_done()
            return event

        self.conn.next_event = observed  # type: ignore[method-assign]


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is optional: h11 then
    HttpToolsProtocol = None


if HttpToolsProtocol is not None:

    class LimitedHttpToolsProtocol(_Limited, HttpToolsProtocol):  # type: ignore[misc, valid-type]
        _head_starts_on_data = False

        def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._init_limits(limits)

        def on_message_begin(self) -> None:
            if self._phase != "head":  # (the connection's first head began at its opening)
                self._begin_head()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._pending = self._head_refusal(self.headers)
            if self._pending is not None:
                raise _Refused  # stops the parser; uvicorn then calls send_400_response
            self._head_done()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._message_done()
            super().on_message_complete()


def protocol_class(http: str, limits: HttpLimits) -> Any:
    if http == "auto":
        http = "httptools" if HttpToolsProtocol is not None else "h11"
    if http == "httptools":
        if HttpToolsProtocol is None:
            raise ValueError("http=httptools, but httptools is not installed")
        return functools.partial(LimitedHttpToolsProtocol, limits=limits)
    if http == "h11":
        return functools.partial(LimitedH11Protocol, limits=limits)
    raise ValueError(f"unknown HTTP parser {http!r}: auto, httptools or h11")


def server_options(limits: HttpLimits, http: str = "auto") -> dict[str, Any]:
    """uvicorn keywords for one of our servers: quiet, no access log, and the HTTP limits."""
    return dict(
        http=protocol_class(http, limits),
        timeout_keep_alive=limits.keep_alive_s,
        limit_concurrency=None,  # the cap is the protocols' (_Limited._head_refusal): a JSON 503
        h11_max_incomplete_event_size=limits.max_url_bytes + limits.max_header_bytes + _H11_SLACK,
        ws="none",  # no route speaks WebSocket: an upgrade request is answered as plain HTTP
        log_level="warning",
        access_log=False,
    )
