"""The decode worker's control plane: `generate` streams token ids; remote prefill is arranged from here.

For a request with a prefill peer, the engine reserves pages; this side then handshakes with the peer
(once per peer instance) and holds the peer's `/internal/prefill` stream open until the KV has landed.
A dropped stream before that means the peer died: the request fails at once instead of at its deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from common.config import WorkerConfig
from common.protocol import (
    AbortRequest,
    GenerateRequest,
    HandshakeRequest,
    HandshakeResponse,
    KVLayoutInfo,
    PrefillRequest,
)
from common.serving.channel import Message
from common.serving.control import WorkerState, create_worker_app, error_response, read_message
from common.serving.engine_host import engine_main
from decode_worker.engine_loop import DecodeHost

log = logging.getLogger("kvferry.decode")

PREFILL_TIMEOUT_S = 60.0


class PeerFailure(RuntimeError):
    pass


@dataclass
class PrefillPeers:
    """Handshakes with prefill workers, by URL; a peer that restarted is handshaken again."""

    state: WorkerState
    http: httpx.AsyncClient
    known: dict[str, HandshakeResponse] = field(default_factory=dict)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    async def ensure(self, url: str, force: bool = False) -> HandshakeResponse:
        lock = self.locks.setdefault(url, asyncio.Lock())
        async with lock:
            if url in self.known and not force:
                return self.known[url]
            agent = self.state.agent
            body = HandshakeRequest(
                agent_name=agent["agent_name"],
                instance_id=agent["instance_id"],
                agent_metadata_b64=agent["agent_metadata_b64"],
                pool_info_b64=agent["pool_info_b64"],
                layout=KVLayoutInfo.model_validate(agent["layout"]),
            )
            try:
                r = await self.http.post(f"{url}/internal/handshake", json=body.model_dump(), timeout=10.0)
            except httpx.HTTPError as e:
                raise PeerFailure(f"handshake with prefill worker {url} failed: {e!r}") from None
            if r.status_code != 200:
                raise PeerFailure(f"prefill worker {url} refused the handshake: {_error_text(r)}")
            resp = HandshakeResponse.model_validate(r.json())
            self.known[url] = resp
            return resp


def _error_text(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except Exception:
        return f"HTTP {r.status_code}"


async def _remote_prefill(state: WorkerState, peers: PrefillPeers, gen: GenerateRequest, pages: list[int]) -> None:
    """Asks the prefill peer to fill `pages`; tells the engine when that cannot happen."""
    assert gen.prefill_url is not None and state.client is not None
    url = gen.prefill_url.rstrip("/")
    error = None
    try:
        for attempt in range(2):
            await peers.ensure(url, force=attempt > 0)
            agent = state.agent
            body = PrefillRequest(
                req_id=gen.req_id,
                token_ids=gen.token_ids,
                sampling=gen.sampling,
                dst_agent=agent["agent_name"],
                dst_instance_id=agent["instance_id"],
                dst_pages=pages,
                deadline_s=PREFILL_TIMEOUT_S,
            )
            async with peers.http.stream(
                "POST",
                f"{url}/internal/prefill",
                json=body.model_dump(),
                timeout=httpx.Timeout(10.0, read=PREFILL_TIMEOUT_S),
            ) as r:
                if r.status_code == 409 and attempt == 0:
                    continue  # the peer restarted and lost our handshake: redo it once
                if r.status_code != 200:
                    await r.aread()
                    raise PeerFailure(f"prefill worker {url} refused the request: {_error_text(r)}")
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    msg = json.loads(line)
                    if "error" in msg:
                        raise PeerFailure(f"prefill failed: {msg['error']}")
                    if msg.get("done"):
                        return
                raise PeerFailure(f"prefill worker {url} closed the stream before finishing")
    except PeerFailure as e:
        error = str(e)
    except (httpx.HTTPError, ValueError) as e:
        error = f"prefill worker {url} failed: {e!r}"
    except asyncio.CancelledError:
        return
    if error is not None:
        peers.known.pop(url, None)
        state.client.cast({"op": "prefill_failed", "req_id": gen.req_id, "error": error})


def _add_routes(app: FastAPI, state: WorkerState) -> None:
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
    peers = PrefillPeers(state, http)
    reservations: dict[str, asyncio.Future[list[int]]] = {}

    def on_reserved(msg: Message) -> None:
        fut = reservations.get(msg["req_id"])
        if fut is not None and not fut.done():
            fut.set_result(msg["pages"])

    state.event_handlers["reserved"] = on_reserved

    @app.post("/internal/generate")
    async def generate(request: Request) -> Response:
        gen: GenerateRequest = await read_message(request, GenerateRequest)
        if not state.ready:
            return error_response(503, "decode worker not ready", "unavailable", "not_ready")
        client = state.client
        assert client is not None
        queue = client.open_stream(gen.req_id)
        remote = gen.prefill_url is not None
        if remote:
            reservations[gen.req_id] = asyncio.get_running_loop().create_future()
        try:
            await client.call(
                {
                    "op": "generate",
                    "req_id": gen.req_id,
                    "token_ids": gen.token_ids,
                    "sampling": gen.sampling.model_dump(),
                    "remote": remote,
                    "timeout_s": PREFILL_TIMEOUT_S,
                }
            )
        except BaseException:
            client.close_stream(gen.req_id)
            reservations.pop(gen.req_id, None)
            raise
        state.metrics.prompt.inc(len(gen.token_ids))
        state.inflight += 1

        async def arrange_prefill(reserved: asyncio.Future[list[int]]) -> None:
            try:
                pages = await reserved
            finally:
                reservations.pop(gen.req_id, None)
            await _remote_prefill(state, peers, gen, pages)

        prefill_task = asyncio.create_task(arrange_prefill(reservations[gen.req_id])) if remote else None

        async def stream() -> AsyncIterator[bytes]:
            finished = False
            try:
                while not finished:
                    msg = await queue.get()
                    item = {k: v for k, v in msg.items() if k not in ("ev", "req_id")}
                    state.metrics.generated.inc(len(item.get("token_ids", ())))
                    if "cached_tokens" in item:
                        state.metrics.cached.inc(item["cached_tokens"])
                    if item.get("finish_reason"):
                        finished = True
                        state.observe_finish(item)
                    yield (json.dumps(item) + "\n").encode()
            finally:
                client.close_stream(gen.req_id)
                state.inflight -= 1
                if prefill_task is not None and not prefill_task.done():
                    prefill_task.cancel()
                if not finished:  # the caller went away: free the request's pages now
                    client.cast({"op": "abort", "req_id": gen.req_id})

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    @app.post("/internal/abort")
    async def abort(request: Request) -> Response:
        ab: AbortRequest = await read_message(request, AbortRequest)
        assert state.client is not None
        state.client.cast({"op": "abort", "req_id": ab.req_id})
        return Response(status_code=204)


def create_app(cfg: WorkerConfig | None = None) -> FastAPI:
    cfg = cfg or WorkerConfig.from_env("decode")
    state = WorkerState(cfg, engine_main, DecodeHost)
    return create_worker_app(state, _add_routes)
