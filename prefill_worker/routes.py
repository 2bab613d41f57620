"""The prefill role's control plane: handshakes with decode peers, their prefills (``PrefillExchange``, one per
request: the job in the engine, heartbeats while it runs, the done line), their cancels, transfer stats."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from msgspec.structs import asdict

from common.protocol import CancelTransfers, HandshakeRequest, HandshakeResponse, PrefillProgress, PrefillRequest
from common.worker.channel import ENGINE_TIMEOUT, EngineError
from common.worker.http_errors import error_response, message_response, read_message
from common.worker.messages import (
    AddPeer,
    Cancel,
    Prefill,
    PrefillDone,
    PrefillError,
    StreamEvent,
    Tokens,
    TransferStats,
    Unanswered,
)
from common.worker.request import WorkerRequest, read_when_ready
from common.worker.request_trace import PREFILL_SPANS, WorkerTrace
from common.worker.worker_state import WorkerState
from prefill_worker.liveness import EngineMotion

HEARTBEAT_S = 1.0  # a progress line this often while the engine works on (or ahead of) a request
HEARTBEAT = b'{"heartbeat":true}\n'


class PrefillExchange(WorkerRequest):
    """A decode peer's prefill here: its progress lines (heartbeats while the engine moves, then the done or
    error line) are the peer's sign that a write of it may still come (decode_worker/remote_prefill.py)."""

    spans = PREFILL_SPANS
    gone = "the decode worker went away"
    heartbeat_s = HEARTBEAT_S

    def __init__(self, state: WorkerState, pr: PrefillRequest, trace: WorkerTrace) -> None:
        super().__init__(state, pr.req_id, trace)
        self.pr = pr
        self.dest = (pr.dst_agent, pr.dst_instance_id)  # the decode worker's agent and instance it sends to
        self.motion = EngineMotion(lambda: state.load, lambda: state.proc.pid if state.proc is not None else None)

    async def begin(self) -> None:
        await self.submit(Prefill(self.pr, self.trace.received), len(self.pr.token_ids), prefill_here=True)

    def call_failed(self, exc: BaseException) -> None:
        if isinstance(exc, EngineError) and exc.code == ENGINE_TIMEOUT:
            # Answered 504, not a refusal: the engine may still take it (then it stops it) or refuse it (then it
            # tells the decode worker no write comes); either way the decode side hears it.
            self.end(abort=False)
            self.client.cast(Unanswered(self.req_id))
            return
        super().call_failed(exc)

    def heartbeat(self) -> bytes | None:
        # The decode side waits as long as this keeps coming (decode_worker/remote_prefill.py).
        return HEARTBEAT if self.motion.moved() else None

    def line(self, ev: StreamEvent) -> PrefillProgress | None:
        metrics = self.state.metrics
        if isinstance(ev, PrefillDone):
            self.finished = True
            metrics.requests.labels(outcome="done").inc()
            metrics.cached.inc(ev.cached_tokens)
            metrics.engine.observe_prefill_done(ev.timeline or {}, ev.transfer)
            self.trace.stamps = ev.timeline or {}
            if ev.transfer is not None and ev.transfer.span is not None:
                self.trace.extra = [("kv transfer", *ev.transfer.span)]
            return PrefillProgress(req_id=self.req_id, done=True, descs=ev.descs, cached_tokens=ev.cached_tokens)
        if isinstance(ev, PrefillError) or (isinstance(ev, Tokens) and ev.line.finish_reason == "error"):
            # A Tokens error: the engine exited (``retryable``, common/worker/channel.py) or failed the request. An
            # exited engine writes nothing more and sends no notice: the line says so, and the decode side frees
            # its pages on it.
            self.finished = True
            metrics.requests.labels(outcome="abort" if self.called_off else "error").inc()
            self.trace.stamps = {}
            error = ev.error if isinstance(ev, PrefillError) else ev.line.error
            exited = isinstance(ev, Tokens) and ev.line.retryable
            return PrefillProgress(req_id=self.req_id, error=error or "prefill failed", engine_exited=exited)
        return None


def add_prefill_routes(app: FastAPI, state: WorkerState) -> None:
    @app.post("/internal/handshake")
    async def handshake(request: Request) -> Response:
        hs = await read_when_ready(request, state, HandshakeRequest)
        if isinstance(hs, Response):
            return hs
        assert state.client is not None
        added = await state.client.call(AddPeer(hs))
        return message_response(
            HandshakeResponse(agent_name=added.agent_name, instance_id=added.instance_id, layout=added.layout)
        )

    @app.post("/internal/prefill")
    async def prefill(request: Request) -> Response:
        pr = await read_when_ready(request, state, PrefillRequest)
        if isinstance(pr, Response):
            return pr
        live = state.requests.get(pr.req_id)
        if live is not None:
            # A second copy: the live exchange keeps its stream and registration (the engine refuses the same).
            if isinstance(live, PrefillExchange) and live.dest == (pr.dst_agent, pr.dst_instance_id):
                message, code = f"duplicate request id {pr.req_id!r}: already on its way to you", "duplicate_request"
            else:
                message, code = f"request id {pr.req_id!r} is in use by another decode worker's", "request_id_in_use"
            return error_response(409, message, "invalid_request_error", code)
        exchange = PrefillExchange(state, pr, WorkerTrace("prefill", pr.req_id, request.headers.get("traceparent")))
        await exchange.begin()
        return exchange.response()

    @app.post("/internal/cancel")
    async def cancel(request: Request) -> Response:
        """A decode worker gave these requests up (decode_worker/remote_prefill.py): those in flight here are
        aborted, the others refused should they arrive later; each one's exchange tells the decode side the rest."""
        ct = await read_message(request, CancelTransfers)
        assert state.client is not None
        for rid in ct.req_ids:
            live = state.requests.get(rid)
            if live is not None:
                live.called_off = True
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
