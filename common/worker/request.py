"""One request on a worker's control plane, from its arrival to the end of its stream however that comes.

Both roles' requests are a ``WorkerRequest``: the decode role's generate stream (decode_worker/routes.py) and
the prefill role's exchange with the decode peer it prefills for (prefill_worker/routes.py) differ only in
their hooks: what a stream event becomes on the wire (``line``), what a failed engine call leaves behind
(``call_failed``) and what else the request lets go of when it ends (``let_go``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, ClassVar, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from common.managed_stream import ManagedStream
from common.protocol import encode
from common.worker.channel import ENGINE_TIMEOUT, EngineError
from common.worker.http_errors import error_response, read_message
from common.worker.messages import Abort, Command, StreamEvent
from common.worker.request_trace import WorkerTrace
from common.worker.worker_state import WorkerState

__all__ = ["WorkerRequest", "read_when_ready"]

T = TypeVar("T")


async def read_when_ready(request: Request, state: WorkerState, model: type[T]) -> T | JSONResponse:
    """The request's message, or the answer to a request that may not start yet (503): the same on every route
    of every role. A malformed body is refused (400) first, ready or not."""
    message = await read_message(request, model)
    if not state.ready:
        return error_response(503, f"{state.cfg.role} worker not ready", "unavailable", "not_ready")
    return message


class WorkerRequest:
    spans: ClassVar[tuple[tuple[str, str, str], ...]]  # its trace's child spans (request_trace.py)
    gone: ClassVar[str]  # its trace's error when the caller leaves before the last line
    heartbeat_s: ClassVar[float | None] = None  # `heartbeat` is asked for a line after this long without an event

    def __init__(self, state: WorkerState, req_id: str, trace: WorkerTrace) -> None:
        assert state.client is not None
        self.state = state
        self.client = state.client
        self.req_id = req_id
        self.trace = trace
        self.finished = False  # its last line is out
        self.ended = False  # let go of here (`end`)
        self.called_off = False  # stopped by its caller (/internal/abort, a cancel): a failure counts as "abort"
        self.queue = self.client.open_stream(req_id)
        state.requests[req_id] = self

    async def submit(self, cmd: Command[None], prompt_tokens: int, prefill_here: bool) -> None:
        """Hands the request to the engine, which answers once it is queued."""
        try:
            await self.client.call(cmd)
        except BaseException as exc:
            self.call_failed(exc)
            raise
        self.state.metrics.prompt.inc(prompt_tokens)
        self.state.accepted.add(self.req_id, prompt_tokens, prefill_here)
        if prefill_here:
            self.state.prompt_tokens_accepted += prompt_tokens

    def call_failed(self, exc: BaseException) -> None:
        """The engine refused the request, answered too late, or the caller left meanwhile. Unless refused, the
        engine may still take it: stop it then."""
        self.end(abort=not isinstance(exc, EngineError) or exc.code == ENGINE_TIMEOUT)

    def end(self, abort: bool) -> None:
        """Lets go of everything the request holds here, at once (no await: nothing can interrupt it) and once.
        ``abort``: the engine may still hold the request (its caller went away): stop it, which frees its pages
        (or holds them while a peer may still write them)."""
        if self.ended:
            return
        self.ended = True
        self.state.requests.pop(self.req_id, None)
        self.state.accepted.ended(self.req_id)
        self.client.close_stream(self.req_id)
        self.let_go(abort)

    def let_go(self, abort: bool) -> None:
        """The role's part of `end`; here, the engine's copy stopped."""
        if abort:
            self.client.cast(Abort(self.req_id))

    def line(self, ev: StreamEvent) -> Any:
        """The protocol message an engine event becomes on the stream (None: nothing to send); sets
        ``finished`` on the last one."""
        raise NotImplementedError

    def heartbeat(self) -> bytes | None:
        """A line for a stream quiet for ``heartbeat_s`` (None: nothing to send)."""
        return None

    async def lines(self) -> AsyncIterator[bytes]:
        """The engine's events as NDJSON lines for the caller, until the last one."""
        while not self.finished:
            if self.heartbeat_s is None:
                ev = await self.queue.get()
            else:
                try:
                    async with asyncio.timeout(self.heartbeat_s):
                        ev = await self.queue.get()
                except TimeoutError:
                    beat = self.heartbeat()
                    if beat is not None:
                        yield beat
                    continue
            msg = self.line(ev)
            if msg is not None:
                yield encode(msg) + b"\n"

    async def on_close(self) -> None:
        # However the response ended: streamed to its last line, or the caller gone at any moment (Starlette
        # cancels the stream when it sees the disconnect, even before the stream's first step).
        self.end(abort=not self.finished)
        self.trace.end(self.spans, error=None if self.finished else self.gone)
        if not self.finished:
            self.state.metrics.requests.labels(outcome="abort").inc()

    def response(self) -> ManagedStream:
        return ManagedStream(self.lines(), self.on_close, "application/x-ndjson")
