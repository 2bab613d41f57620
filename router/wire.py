"""A minimal HTTP/1.1 client for the router's calls to workers, on asyncio streams: httpx cost a streamed POST
about ten times the CPU its bytes need, which alone broke the router's added-latency budget. Plain HTTP/1.1 to
known workers only: pooled keep-alive connections, one write per request, responses read with their framing.
A pooled connection found closed (EOF before any byte) resends once; idle ones drop before the workers'
keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from common import settings_registry as reg

__all__ = ["ConnectError", "ProtocolError", "Response", "WireClient", "WireError"]

_IDLE_S = 4.0  # well under the workers' keep-alive timeout (KVFERRY_HTTP_KEEP_ALIVE_S, 75 s by default)
_MAX_IDLE_PER_HOST = 256
_MAX_LINE = 1 << 20


class WireError(Exception):
    """Any failure talking to a worker."""


class ConnectError(WireError):
    """Refused or unreachable (nothing listens), or, with ``timed_out``, no answer to the connect in time (a
    full accept queue looks the same)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class ProtocolError(WireError):
    """The peer closed the connection or sent something that is not HTTP/1.1."""


@dataclass
class _Conn:
    key: tuple[str, int]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0
    reused: bool = False

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # already torn down
            pass


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    _conn: _Conn | None
    _client: WireClient
    _chunked: bool = False
    _length: int | None = None
    _done: bool = False
    _buf: bytearray = field(default_factory=bytearray)
    _keep_alive: bool = True

    # The body is read in whatever pieces the socket gives and unframed into _buf, whose complete lines are then
    # taken without waiting (line_nowait): a caller that fell behind catches up in one go.
    _raw: bytearray = field(default_factory=bytearray)  # read, framing not yet undone
    _chunk_left: int = 0  # chunked: data bytes left in this chunk; 0: a size line next; -1: its CRLF; -2: trailers

    def _unframe(self) -> None:
        raw, buf = self._raw, self._buf
        if not self._chunked:
            if self._length is None:
                buf += raw
            else:
                n = min(self._length, len(raw))
                buf += raw[:n]
                self._length -= n
                self._done = self._length == 0
            raw.clear()
            return
        while raw and not self._done:
            left = self._chunk_left
            if left > 0:
                n = min(left, len(raw))
                buf += raw[:n]
                del raw[:n]
                self._chunk_left = -1 if n == left else left - n
                continue
            nl = raw.find(b"\n")
            if nl < 0:
                if len(raw) > _MAX_LINE:
                    raise ProtocolError("chunk header too long")
                return
            line = bytes(raw[:nl]).strip()
            del raw[: nl + 1]
            if left == -1:  # the CRLF after a chunk's data
                if line:
                    raise ProtocolError("chunk data longer than its size")
                self._chunk_left = 0
            elif left == -2:  # trailers, up to an empty line
                self._done = not line
            else:
                try:
                    size = int(line.split(b";", 1)[0] or b"0", 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {line[:40]!r}") from None
                self._chunk_left = size if size > 0 else -2

    async def _fill(self) -> bool:
        """Reads what the socket has into the body buffer; False once the body ended."""
        if self._done or self._conn is None:
            return False
        try:
            data = await self._conn.reader.read(65536)
        except ConnectionError as exc:
            raise ProtocolError(f"reading the response failed: {exc!r}") from None
        if not data:
            if self._chunked or self._length is not None:
                raise ProtocolError("connection closed before the end of the body")
            self._done = True  # no framing: the body ends when the peer closes
            self._keep_alive = False
            return False
        self._raw += data
        self._unframe()
        return True

    @property
    def ended(self) -> bool:
        return self._done or self._conn is None

    def line_nowait(self) -> bytes | None:
        """The next complete line of the body if already here, else None."""
        buf = self._buf
        nl = buf.find(b"\n")
        if nl < 0:
            return None
        line = bytes(buf[:nl])
        del buf[: nl + 1]
        return line

    async def next_line(self) -> bytes | None:
        """The next line of the body (without its line end); None at its end."""
        while True:
            line = self.line_nowait()
            if line is not None:
                return line
            if len(self._buf) > _MAX_LINE:
                raise ProtocolError("line too long")
            if not await self._fill():
                if self._buf:
                    rest = bytes(self._buf)
                    self._buf.clear()
                    return rest
                return None

    async def lines(self) -> AsyncIterator[bytes]:
        while (line := await self.next_line()) is not None:
            yield line

    async def read(self) -> bytes:
        while await self._fill():
            pass
        out = bytes(self._buf)
        self._buf.clear()
        return out

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Returns the connection to the pool if the body was read to its end, else closes it (for a generate
        stream, the worker's abort signal). Never waits, so no cancellation can interrupt it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep_alive:
            self._client._release(conn)
        else:
            conn.close()


class WireClient:
    def __init__(
        self, connect_timeout_s: float = reg.ROUTER_CONNECT_TIMEOUT_S.default, headers: dict[str, str] | None = None
    ) -> None:
        """``headers``: sent on every request (the internal token)."""
        self.connect_timeout_s = connect_timeout_s
        self._fixed_head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._closed = False

    @staticmethod
    def _target(url: str) -> tuple[tuple[str, int], str, str]:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise WireError(f"only plain http:// URLs are supported, got {url!r}")
        port = parts.port or 80
        host = parts.hostname
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return (host, port), netloc, path

    async def _acquire(self, key: tuple[str, int]) -> _Conn:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < _IDLE_S and not conn.reader.at_eof() and not conn.writer.is_closing():
                conn.reused = True
                return conn
            conn.close()
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can return the connection and lose a cancel.
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(key[0], key[1], limit=_MAX_LINE)
        except TimeoutError:
            raise ConnectError(f"no answer connecting to {key[0]}:{key[1]}", timed_out=True) from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc!r}") from None
        return _Conn(key, reader, writer)

    def _release(self, conn: _Conn) -> None:
        if self._closed or conn.writer.is_closing():
            conn.close()
            return
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= _MAX_IDLE_PER_HOST:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> Response:
        """Sends a request and reads the status line and headers; ``headers``: extra ones (a traceparent)."""
        key, netloc, path = self._target(url)
        head = f"{method} {path} HTTP/1.1\r\nhost: {netloc}\r\n{self._fixed_head}"
        if body or method in ("POST", "PUT", "PATCH"):
            head += f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        if headers:
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        payload = head.encode() + b"\r\n" + body
        for attempt in range(2):
            conn = await self._acquire(key)
            try:
                conn.writer.write(payload)
                if conn.writer.transport.get_write_buffer_size() > 65536:
                    await conn.writer.drain()
                status_line = await conn.reader.readline()
                if not status_line:
                    raise ProtocolError("connection closed before the response")
                return await self._read_head(conn, status_line)
            except (ProtocolError, ConnectionError, asyncio.IncompleteReadError) as exc:
                conn.close()
                # A reused connection the worker had already closed: it never saw this request.
                if conn.reused and attempt == 0:
                    continue
                if isinstance(exc, ProtocolError):
                    raise
                raise ProtocolError(f"request to {url} failed: {exc!r}") from None
            except BaseException:
                conn.close()  # cancelled or timed out mid-request: the connection state is unknown
                raise
        raise ProtocolError(f"request to {url} failed")  # unreachable: the loop returns or raises

    async def _read_head(self, conn: _Conn, status_line: bytes) -> Response:
        try:
            version, code, *_ = status_line.decode("latin-1").split(" ", 2)
            status = int(code)
        except ValueError:
            raise ProtocolError(f"bad status line {status_line!r}") from None
        if not version.startswith("HTTP/1."):
            raise ProtocolError(f"bad status line {status_line!r}")
        headers: dict[str, str] = {}
        while True:
            line = await conn.reader.readline()
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise ProtocolError("connection closed inside the response headers")
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        resp = Response(status, headers, conn, self)
        resp._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not resp._chunked and "content-length" in headers:
            resp._length = int(headers["content-length"])
        resp._keep_alive = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        if status in (204, 304) or (not resp._chunked and resp._length == 0):
            resp._done = True
        return resp

    async def get_json_body(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        async with asyncio.timeout(timeout_s):
            resp = await self.request("GET", url)
            try:
                return resp.status, await resp.read()
            finally:
                await resp.aclose()

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
