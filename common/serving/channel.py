"""The local channel between a worker's control plane (HTTP) and its engine process (scheduler loop).

Messages are JSON objects over a multiprocessing pipe (bytes framed by the pipe; never pickled), so the
engine loop never waits on HTTP work and the control plane never waits on a model step.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger("kvferry.channel")

CALL_TIMEOUT_S = 30.0
ENGINE_TIMEOUT = "engine_timeout"  # EngineError code of a call the engine did not answer in time
ENGINE_EXITED = "engine process exited"

Message = dict[str, Any]


def send(conn: Connection, msg: Message, lock: threading.Lock | None = None) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    if lock is None:
        conn.send_bytes(data)
    else:
        with lock:
            conn.send_bytes(data)


def recv(conn: Connection) -> Message:
    return json.loads(conn.recv_bytes())


class EngineClient:
    """Control-plane end: request/reply calls, per-request event streams, and engine-wide events."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, on_event: Callable[[Message], None]) -> None:
        self.conn = conn
        self.loop = loop
        self.on_event = on_event
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[Message]] = {}
        self.streams: dict[str, asyncio.Queue[Message]] = {}
        self.closed = asyncio.Event()
        self._reader = threading.Thread(target=self._read_loop, name="engine-channel", daemon=True)
        self._reader.start()

    def cast(self, msg: Message) -> None:
        """Sends a command without waiting; to an engine that is gone it is moot (its requests ended with it)."""
        try:
            send(self.conn, msg, self._lock)
        except OSError:
            log.debug("command to an exited engine dropped", extra={"op": msg.get("op")})

    async def call(self, msg: Message, timeout: float = CALL_TIMEOUT_S) -> Message:
        """Sends a command and waits for its reply. Raises EngineError: the engine refused it, exited, or did
        not answer within ``timeout`` (code ``engine_timeout``: a busy engine, e.g. several CPU engines on two
        cores; the command may still run later, so the caller undoes what it would have started)."""
        if self.closed.is_set():
            raise EngineError(ENGINE_EXITED, "engine_exited")
        rid = next(self._ids)
        fut: asyncio.Future[Message] = self.loop.create_future()
        self._replies[rid] = fut
        try:
            try:
                send(self.conn, {**msg, "rpc": rid}, self._lock)
            except OSError:
                raise EngineError(ENGINE_EXITED, "engine_exited") from None
            async with asyncio.timeout(timeout):
                reply = await fut
        except TimeoutError:
            op = msg.get("op", "?")
            raise EngineError(f"the engine did not answer {op!r} within {timeout:g}s", ENGINE_TIMEOUT) from None
        finally:
            self._replies.pop(rid, None)
        if not reply.get("ok", False):
            raise EngineError(reply.get("error", "engine error"), reply.get("code", "engine_error"))
        return reply

    def open_stream(self, req_id: str) -> asyncio.Queue[Message]:
        q: asyncio.Queue[Message] = asyncio.Queue()
        self.streams[req_id] = q
        return q

    def close_stream(self, req_id: str) -> None:
        self.streams.pop(req_id, None)

    def _dispatch(self, msg: Message) -> None:
        rid = msg.get("rpc")
        if rid is not None and "op" not in msg:
            fut = self._replies.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            return
        if msg.get("ev") == "req":
            q = self.streams.get(msg["req_id"])
            if q is not None:
                q.put_nowait(msg)
            return
        self.on_event(msg)

    def _read_loop(self) -> None:
        try:
            while True:
                msg = recv(self.conn)
                self.loop.call_soon_threadsafe(self._dispatch, msg)
        except (EOFError, OSError):
            pass
        except Exception:  # a malformed message from our own engine is a bug: say so, then stop
            log.exception("engine channel reader failed")
        self.loop.call_soon_threadsafe(self._on_closed)

    def _on_closed(self) -> None:
        self.closed.set()
        for q in self.streams.values():
            # Nothing of the request is lost but this worker: the router may continue it on another one.
            q.put_nowait({"ev": "req", "finish_reason": "error", "error": ENGINE_EXITED, "retryable": True})
        for fut in self._replies.values():
            if not fut.done():
                fut.set_result({"ok": False, "error": ENGINE_EXITED, "code": "engine_exited"})


class EngineError(RuntimeError):
    def __init__(self, message: str, code: str = "engine_error") -> None:
        super().__init__(message)
        self.code = code
