"""The prefill role's control plane: handshake with decode peers, accept prefill jobs, report progress."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.protocol import AbortRequest, HandshakeRequest, HandshakeResponse, KVLayoutInfo, PrefillRequest
from common.serving.channel import ENGINE_TIMEOUT, EngineError
from common.serving.control import WorkerState, error_response, read_message
from common.serving.liveness import EngineMotion
from common.serving.request_trace import PREFILL_SPANS, WorkerTrace

HEARTBEAT_S = 1.0  # a progress line this often while the engine works on (or ahead of) a request
HEARTBEAT = b'{"heartbeat":true}\n'


def add_prefill_routes(app: FastAPI, state: WorkerState, abort_route: bool = True) -> None:
    """`abort_route` False: the app has its own `/internal/abort` (a mixed worker's decode routes), whose engine
    abort reaches requests of either role."""
    aborted: set[str] = set()  # prefills the decode side called off: counted "abort", not "error"

    @app.post("/internal/handshake")
    async def handshake(request: Request) -> Response:
        hs: HandshakeRequest = await read_message(request, HandshakeRequest)  # type: ignore[assignment]
        if not state.ready:
            return error_response(503, "prefill worker not ready", "unavailable", "not_ready")
        assert state.client is not None
        reply = await state.client.call({"op": "add_peer", "handshake": hs.model_dump()})
        resp = HandshakeResponse(
            agent_name=reply["agent_name"],
            instance_id=reply["instance_id"],
            layout=KVLayoutInfo.model_validate(reply["layout"]),
        )
        return JSONResponse(resp.model_dump())

    @app.post("/internal/prefill")
    async def prefill(request: Request) -> Response:
        pr: PrefillRequest = await read_message(request, PrefillRequest)  # type: ignore[assignment]
        if not state.ready:
            return error_response(503, "prefill worker not ready", "unavailable", "not_ready")
        client = state.client
        assert client is not None
        queue = client.open_stream(pr.req_id)
        trace = WorkerTrace("prefill", pr.req_id, request.headers.get("traceparent"))
        try:
            await client.call({"op": "prefill", "prefill": pr.model_dump(), "received": trace.received})
        except EngineError as exc:
            client.close_stream(pr.req_id)
            if exc.code == ENGINE_TIMEOUT:  # the engine may still take it: stop it then (answered 504, not a refusal)
                client.cast({"op": "abort", "req_id": pr.req_id, "error": "the engine answered too late"})
            raise
        except BaseException:
            client.close_stream(pr.req_id)
            # The caller went away while the engine may have accepted it: stop it (a no-op if it did not).
            client.cast({"op": "abort", "req_id": pr.req_id, "error": "decode worker disconnected"})
            raise
        state.metrics.prompt.inc(len(pr.token_ids))
        state.accepted.add(pr.req_id, len(pr.token_ids), prefill_here=True)
        state.inflight += 1

        async def progress() -> AsyncIterator[bytes]:
            finished = False
            motion = EngineMotion(lambda: state.load, lambda: state.proc.pid if state.proc is not None else None)
            try:
                while True:
                    try:
                        msg = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
                    except TimeoutError:
                        # The decode side waits as long as this keeps coming (decode_worker/app.py).
                        if motion.moved():
                            yield HEARTBEAT
                        continue
                    if "done" in msg or "error" in msg or msg.get("finish_reason") == "error":
                        finished = True
                        outcome = "done" if "error" not in msg else "abort" if pr.req_id in aborted else "error"
                        state.metrics.requests.labels(outcome=outcome).inc()
                        if outcome == "done":
                            state.metrics.cached.inc(msg.get("cached_tokens", 0))
                        stamps, transfer = msg.pop("timeline", None) or {}, msg.pop("transfer", None)
                        if outcome == "done":
                            state.metrics.engine.observe_prefill_done(stamps, transfer)
                        trace.stamps = stamps
                        if transfer and "span" in transfer:
                            trace.extra = [("kv transfer", *transfer["span"])]
                        yield (json.dumps({k: v for k, v in msg.items() if k not in ("ev",)}) + "\n").encode()
                        return
            finally:
                trace.end(PREFILL_SPANS, error=None if finished else "the decode worker went away")
                client.close_stream(pr.req_id)
                state.accepted.ended(pr.req_id)
                state.inflight -= 1
                aborted.discard(pr.req_id)
                if not finished:  # the decode worker went away: stop computing and free the pages
                    client.cast({"op": "abort", "req_id": pr.req_id, "error": "decode worker disconnected"})
                    state.metrics.requests.labels(outcome="abort").inc()

        return StreamingResponse(progress(), media_type="application/x-ndjson")

    if abort_route:

        @app.post("/internal/abort")
        async def abort(request: Request) -> Response:
            ab: AbortRequest = await read_message(request, AbortRequest)  # type: ignore[assignment]
            assert state.client is not None
            if ab.req_id in state.client.streams:
                aborted.add(ab.req_id)
            state.client.cast({"op": "abort", "req_id": ab.req_id, "error": "aborted"})
            return JSONResponse({"status": "ok"})

    @app.get("/internal/agent")
    async def agent() -> Response:
        """Which NIXL agent instance serves here and whether its engine lives: a decode worker that gave up
        on a request asks, to learn that the instance it sent it to is gone (then nothing of it can land)."""
        return JSONResponse(
            {
                "agent": state.agent.get("agent_name"),
                "instance_id": state.agent.get("instance_id"),
                "engine_alive": state.alive,
            }
        )

    @app.get("/internal/stats")
    async def stats() -> Response:
        """The engine's transfer counters: writes NIXL still holds, open sessions by state, totals."""
        body: dict[str, object] = {
            "agent": state.agent.get("agent_name"),
            "instance_id": state.agent.get("instance_id"),
        }
        if state.alive and state.client is not None:
            try:
                reply = await state.client.call({"op": "transfer_stats"}, timeout=5.0)
            except (EngineError, TimeoutError):
                reply = {}
            body["transfer"] = {k: v for k, v in reply.items() if k not in ("rpc", "ok")}
        return JSONResponse(body)
