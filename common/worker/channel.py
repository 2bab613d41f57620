"""The local channel between a worker's control plane (HTTP) and its engine process (scheduler loop).

Messages are the structs of common/worker/messages.py, as JSON over a multiprocessing pipe (bytes framed
by the pipe; never pickled), so the engine loop never waits on HTTP work and the control plane never waits
on a model step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from common.protocol import TokenLine
from common.settings_registry import FAULT_ENGINE_CALL_TIMEOUT_S
from common.worker.messages import Batch, Call, Command, Event, Reply, StreamEvent, Tokens, Wire, decode, encode

log = logging.getLogger("kvferry.channel")

# How long the control plane waits for its engine's answer; the engine reads commands at least every planned
# step (KVFERRY_MAX_STEP_MS), so only a starved engine misses it. The test hook shortens it (a busy engine).
CALL_TIMEOUT_S = FAULT_ENGINE_CALL_TIMEOUT_S.read() or 30.0
ENGINE_TIMEOUT = "engine_timeout"  # EngineError code of a call the engine did not answer in time
ENGINE_EXITED = "engine process exited"

R = TypeVar("R")


def send(conn: Connection, msg: Wire, lock: threading.Lock | None = None) -> None:
    data = encode(msg)
    if lock is None:
        conn.send_bytes(data)
    else:
        with lock:
            conn.send_bytes(data)


def recv(conn: Connection) -> Wire:
    return decode(conn.recv_bytes())


class EngineClient:
    """Control-plane end: request/reply calls, per-request event streams, and engine-wide events (handed to
    ``on_event``, one at a time: a ``Batch`` is unpacked here)."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, on_event: Callable[[Event], None]) -> None:
        self.conn = conn
        self.loop = loop
        self.on_event = on_event
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[Reply]] = {}
        self.streams: dict[str, asyncio.Queue[StreamEvent]] = {}
        self.closed = asyncio.Event()
        self._reader = threading.Thread(target=self._read_loop, name="engine-channel", daemon=True)
        self._reader.start()

    def cast(self, cmd: Command[Any]) -> None:
        """Sends a command without waiting; to an engine that is gone it is moot (its requests ended with it)."""
        try:
            send(self.conn, cmd, self._lock)
        except OSError:
            log.debug("command to an exited engine dropped", extra={"op": cmd.name()})

    async def call(self, cmd: Command[R], timeout: float = CALL_TIMEOUT_S) -> R:
        """Sends a command and waits for its reply's result. Raises EngineError: the engine refused it, exited,
        or did not answer within ``timeout`` (code ``engine_timeout``: a busy engine, e.g. several CPU engines
        on two cores; the command may still run later, so the caller undoes what it would have started)."""
        if self.closed.is_set():
            raise EngineError(ENGINE_EXITED, "engine_exited")
        rid = next(self._ids)
        fut: asyncio.Future[Reply] = self.loop.create_future()
        self._replies[rid] = fut
        try:
            try:
                send(self.conn, Call(rid, cmd), self._lock)
            except OSError:
                raise EngineError(ENGINE_EXITED, "engine_exited") from None
            async with asyncio.timeout(timeout):
                reply = await fut
        except TimeoutError:
            raise EngineError(f"the engine did not answer {cmd.name()!r} within {timeout:g}s", ENGINE_TIMEOUT) from None
        finally:
            self._replies.pop(rid, None)
        if reply.error is not None:
            raise EngineError(reply.error, reply.code or "engine_error")
        return reply.result  # type: ignore[return-value]

    def open_stream(self, req_id: str) -> asyncio.Queue[StreamEvent]:
        q: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.streams[req_id] = q
        return q

    def close_stream(self, req_id: str) -> None:
        self.streams.pop(req_id, None)

    def _deliver(self, msg: Wire) -> None:
        if isinstance(msg, Batch):
            for item in msg.items:
                self._deliver(item)
        elif isinstance(msg, Reply):
            fut = self._replies.get(msg.rpc)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, StreamEvent):
            q = self.streams.get(msg.req_id)
            if q is not None:
                q.put_nowait(msg)
        elif isinstance(msg, Event):
            self.on_event(msg)
        else:
            log.error("not an engine event", extra={"type": type(msg).__name__})

    def _read_loop(self) -> None:
        try:
            while True:
                msg = recv(self.conn)
                self.loop.call_soon_threadsafe(self._deliver, msg)
        except (EOFError, OSError):
            pass
        except Exception:  # a malformed message from our own engine is a bug: say so, then stop
            if self.loop.is_closed():  # no: the control plane's loop closed first, nobody is left to tell
                return
            log.exception("engine channel reader failed")
        try:
            self.loop.call_soon_threadsafe(self._on_closed)
        except RuntimeError:  # the loop closed first (the control plane stopped): nothing waits on the engine
            pass

    def _on_closed(self) -> None:
        self.closed.set()
        for rid, q in self.streams.items():
            # Nothing of the request is lost but this worker: the router may continue it on another one.
            q.put_nowait(Tokens(rid, TokenLine(finish_reason="error", error=ENGINE_EXITED, retryable=True)))
        for fut in self._replies.values():
            if not fut.done():
                fut.set_result(Reply(0, error=ENGINE_EXITED, code="engine_exited"))


class EngineError(RuntimeError):
    def __init__(self, message: str, code: str = "engine_error") -> None:
        super().__init__(message)
        self.code = code
