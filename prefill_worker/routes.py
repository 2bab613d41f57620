"""The prefill role's control plane: handshake with decode peers, accept prefill jobs, report progress."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from msgspec.structs import asdict

from common.managed_stream import ManagedStream
from common.protocol import (
    CancelTransfers,
    HandshakeRequest,
    HandshakeResponse,
    PrefillProgress,
    PrefillRequest,
    encode,
)
from common.worker.channel import ENGINE_TIMEOUT, EngineError
from common.worker.http_errors import error_response, message_response, read_message
from common.worker.messages import (
    Abort,
    AddPeer,
    Cancel,
    Prefill,
    PrefillDone,
    PrefillError,
    Tokens,
    TransferStats,
    Unanswered,
)
from common.worker.request_trace import PREFILL_SPANS, WorkerTrace
from common.worker.worker_state import WorkerState
from prefill_worker.liveness import EngineMotion

HEARTBEAT_S = 1.0  # a progress line this often while the engine works on (or ahead of) a request
HEARTBEAT = b'{"heartbeat":true}\n'


def add_prefill_routes(app: FastAPI, state: WorkerState) -> None:
    aborted = state.called_off  # prefills the decode side called off (abort, cancel): counted "abort", not "error"
    sending: dict[str, tuple[str, str]] = {}  # req id -> the (agent, instance) its live exchange here sends to

    @app.post("/internal/handshake")
    async def handshake(request: Request) -> Response:
        hs = await read_message(request, HandshakeRequest)
        if not state.ready:
            return error_response(503, "prefill worker not ready", "unavailable", "not_ready")
        assert state.client is not None
        added = await state.client.call(AddPeer(hs))
        return message_response(
            HandshakeResponse(agent_name=added.agent_name, instance_id=added.instance_id, layout=added.layout)
        )

    @app.post("/internal/prefill")
    async def prefill(request: Request) -> Response:
        pr = await read_message(request, PrefillRequest)
        if not state.ready:
            return error_response(503, "prefill worker not ready", "unavailable", "not_ready")
        client = state.client
        assert client is not None
        dest = (pr.dst_agent, pr.dst_instance_id)
        if pr.req_id in sending or pr.req_id in client.streams:
            # A second copy: the live exchange keeps its stream and registration (the engine refuses the same).
            if sending.get(pr.req_id) == dest:
                message, code = f"duplicate request id {pr.req_id!r}: already on its way to you", "duplicate_request"
            else:
                message, code = f"request id {pr.req_id!r} is in use by another decode worker's", "request_id_in_use"
            return error_response(409, message, "invalid_request_error", code)
        sending[pr.req_id] = dest
        queue = client.open_stream(pr.req_id)
        state.live.add(pr.req_id)
        trace = WorkerTrace("prefill", pr.req_id, request.headers.get("traceparent"))
        finished = False
        ended = False

        def end(abort: str | None) -> None:
            """Lets go of the request here, at once and once; ``abort``: why the engine must stop it (the
            decode worker went away while the engine may hold it: stop computing and free its pages)."""
            nonlocal ended
            if ended:
                return
            ended = True
            sending.pop(pr.req_id, None)
            state.live.discard(pr.req_id)
            state.accepted.ended(pr.req_id)
            aborted.discard(pr.req_id)
            client.close_stream(pr.req_id)
            if abort is not None:
                client.cast(Abort(pr.req_id, error=abort))

        try:
            await client.call(Prefill(pr, trace.received))
        except EngineError as exc:
            end(None)
            if exc.code == ENGINE_TIMEOUT:
                # Answered 504, not a refusal: the engine may still take it (then it stops it) or refuse it
                # (then it tells the decode worker no write comes); either way the decode side hears it.
                client.cast(Unanswered(pr.req_id))
            raise
        except BaseException:
            # The caller went away while the engine may have accepted it: stop it (a no-op if it did not).
            end("decode worker disconnected")
            raise
        state.metrics.prompt.inc(len(pr.token_ids))
        state.accepted.add(pr.req_id, len(pr.token_ids), prefill_here=True)

        async def progress() -> AsyncIterator[bytes]:
            nonlocal finished
            motion = EngineMotion(lambda: state.load, lambda: state.proc.pid if state.proc is not None else None)
            while True:
                try:
                    async with asyncio.timeout(HEARTBEAT_S):
                        ev = await queue.get()
                except TimeoutError:
                    # The decode side waits as long as this keeps coming (decode_worker/remote_prefill.py).
                    if motion.moved():
                        yield HEARTBEAT
                    continue
                if isinstance(ev, PrefillDone):
                    finished = True
                    state.metrics.requests.labels(outcome="done").inc()
                    state.metrics.cached.inc(ev.cached_tokens)
                    state.metrics.engine.observe_prefill_done(ev.timeline or {}, ev.transfer)
                    trace.stamps = ev.timeline or {}
                    if ev.transfer is not None and ev.transfer.span is not None:
                        trace.extra = [("kv transfer", *ev.transfer.span)]
                    line = PrefillProgress(req_id=pr.req_id, done=True, descs=ev.descs, cached_tokens=ev.cached_tokens)
                elif isinstance(ev, PrefillError) or (isinstance(ev, Tokens) and ev.line.finish_reason == "error"):
                    # A Tokens error: the engine exited (``retryable``, common/worker/channel.py) or failed the
                    # request. An exited engine writes nothing more and sends no notice: the line says so, and
                    # the decode side frees its pages on it.
                    finished = True
                    outcome = "abort" if pr.req_id in aborted else "error"
                    state.metrics.requests.labels(outcome=outcome).inc()
                    trace.stamps = {}
                    error = ev.error if isinstance(ev, PrefillError) else ev.line.error
                    exited = isinstance(ev, Tokens) and ev.line.retryable
                    line = PrefillProgress(req_id=pr.req_id, error=error or "prefill failed", engine_exited=exited)
                else:
                    continue
                yield encode(line) + b"\n"
                return

        async def on_close() -> None:
            end(None if finished else "decode worker disconnected")
            trace.end(PREFILL_SPANS, error=None if finished else "the decode worker went away")
            if not finished:
                state.metrics.requests.labels(outcome="abort").inc()

        return ManagedStream(progress(), on_close, "application/x-ndjson")

    @app.post("/internal/cancel")
    async def cancel(request: Request) -> Response:
        """A decode worker gave these requests up (decode_worker/remote_prefill.py): those in flight here are
        aborted, the others refused should they arrive later; each one's exchange tells the decode side the rest."""
        ct = await read_message(request, CancelTransfers)
        assert state.client is not None
        aborted.update(rid for rid in ct.req_ids if rid in state.client.streams)
        await state.client.call(Cancel(ct.dst_agent, ct.dst_instance_id, ct.req_ids))
        return Response(status_code=204)

    @app.get("/internal/stats")
    async def stats() -> Response:
        """The engine's transfer counters: writes NIXL still holds, open sessions by state, totals."""
        body: dict[str, object] = {
            "agent": state.agent.agent_name if state.agent is not None else None,
            "instance_id": state.agent.instance_id if state.agent is not None else None,
        }
        if state.alive and state.client is not None:
            try:
                counts = await state.client.call(TransferStats(), timeout=5.0)
                body["transfer"] = asdict(counts)
            except (EngineError, TimeoutError):
                body["transfer"] = {}
        return JSONResponse(body)
