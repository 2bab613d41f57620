"""The decode role's control plane: `generate` streams token ids; remote prefill is arranged from here.

For a request with a prefill peer, the engine reserves pages; this side then handshakes with the peer
(once per peer instance), asks the engine's leave to send the page ids (`PrefillSending`: never for a
request given up meanwhile), and holds the peer's `/internal/prefill` stream open until the KV has landed.
How that ends decides what the engine may do with the pages: a refusal (the peer registered nothing) frees
them at once; anything after the peer may have started leaves them held until the peer settles them: its
"closed" notice, or its answer to the cancel `PeerWatch` sends it (never registered there, and refused from
then on), or `PeerWatch` finding the peer's agent instance gone (common/transfer/session.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from common.managed_stream import ManagedStream
from common.protocol import (
    MAX_CANCELS,
    AbortRequest,
    CancelReply,
    CancelTransfers,
    GenerateRequest,
    HandshakeRequest,
    HandshakeResponse,
    KVLayoutInfo,
    PrefillProgress,
    PrefillRequest,
)
from common.serving.channel import ENGINE_TIMEOUT, EngineError
from common.serving.control import WorkerState, error_response, read_message
from common.serving.messages import (
    Abort,
    AgentInfo,
    AwaitingPeers,
    Generate,
    KVForcedRelease,
    PeerGone,
    PrefillFailed,
    PrefillRefused,
    PrefillSending,
    Reserved,
    Tokens,
    TransfersSettled,
)
from common.serving.request_trace import DECODE_SPANS, WorkerTrace
from decode_worker.peer_directory import PeerDirectory

log = logging.getLogger("kvferry.decode")

# A remote prefill is given up when it stops making progress, not after a fixed time: the prefill worker sends a
# progress line at least every second while its engine works (prefill_worker/routes.py), so a long prompt on a busy
# CPU may take minutes while a dead or frozen peer is noticed within PREFILL_STALL_S.
PREFILL_STALL_S = 15.0
PREFILL_HEAD_S = 45.0  # the peer's answer to the prefill request: its engine call may take up to 30 s
# Outer bound of a remote prefill and its KV transfer however it progresses (GenerateRequest.kv_timeout_s
# overrides it); kept under the transfer sessions' 300 s safety deadline (common/transfer/session.py).
PREFILL_DEADLINE_S = 240.0
PROBE_INTERVAL_S = 0.5  # how often a peer that may still write into given-up pages is asked whether it lives
# Answers of a prefill worker that registered nothing (so it writes nothing): bad request, unknown peer
# (handshake again), cancelled before it arrived, queue full, not ready.
REFUSALS = frozenset({400, 409, 410, 429, 503})


class PeerFailure(RuntimeError):
    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message)
        self.started = started  # the peer may have registered the request: writes may still come


@dataclass
class PrefillPeers:
    """Handshakes with prefill workers, by URL; a peer that restarted is handshaken again."""

    state: WorkerState
    http: httpx.AsyncClient
    known: dict[str, HandshakeResponse] = field(default_factory=dict)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    urls: dict[tuple[str, str], str] = field(default_factory=dict)  # (agent, instance) -> URL, kept for PeerWatch

    async def ensure(self, url: str, force: bool = False) -> HandshakeResponse:
        lock = self.locks.setdefault(url, asyncio.Lock())
        async with lock:
            if url in self.known and not force:
                return self.known[url]
            agent = _agent(self.state)
            body = HandshakeRequest(
                agent_name=agent.agent_name,
                instance_id=agent.instance_id,
                agent_metadata_b64=agent.agent_metadata_b64,
                pool_info_b64=agent.pool_info_b64,
                layout=KVLayoutInfo.model_validate(agent.layout),
            )
            started = time.perf_counter()
            try:
                r = await self.http.post(f"{url}/internal/handshake", json=body.model_dump(), timeout=10.0)
            except httpx.HTTPError as e:
                raise PeerFailure(f"handshake with prefill worker {url} failed: {e!r}", started=False) from None
            if r.status_code != 200:
                raise PeerFailure(f"prefill worker {url} refused the handshake: {_error_text(r)}", started=False)
            try:
                resp = HandshakeResponse.model_validate(r.json())
            except ValueError as e:
                raise PeerFailure(f"prefill worker {url} sent a bad handshake: {e}", started=False) from None
            self.known[url] = resp
            self.state.metrics.engine.handshake.observe(time.perf_counter() - started)
            self.urls[(resp.agent_name, resp.instance_id)] = url
            return resp


@dataclass
class PeerWatch:
    """Settles the requests this worker gave up while a prefill peer may still write into their pages. Each
    such peer is sent a cancel for them (``/internal/cancel``), which it answers with those no write of it
    can reach any more (never registered there, now refused; or over); the others it aborts, and its
    "closed" notice settles them once their writes did. Asked again every ``PROBE_INTERVAL_S`` until each is
    settled. A peer that refuses connections, runs another agent instance, or has lost its engine is gone,
    and the engine is told so. A peer that does not answer (frozen, partitioned) is not known gone: its
    pages stay held (until the engine's last-resort deadline)."""

    state: WorkerState
    peers: PrefillPeers
    awaited: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None

    def update(self, ev: AwaitingPeers) -> None:
        self.awaited = {(str(a), str(i)): [str(r) for r in rids] for a, i, rids in ev.peers}
        if self.awaited and (self.task is None or self.task.done()):
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.awaited:
            for (agent, instance), rids in list(self.awaited.items()):
                url = self.peers.urls.get((agent, instance))
                if url is None:
                    continue
                client = self.state.client
                assert client is not None
                if await self._gone(url, instance):
                    log.info("prefill peer gone", extra={"peer": agent, "url": url})
                    self.awaited.pop((agent, instance), None)
                    client.cast(PeerGone(agent, instance))
                    continue
                settled = await self._cancel(url, rids)
                if settled:
                    client.cast(TransfersSettled(agent, instance, settled))
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def _cancel(self, url: str, rids: list[str]) -> list[str]:
        agent = _agent(self.state)
        body = CancelTransfers(
            dst_agent=agent.agent_name, dst_instance_id=agent.instance_id, req_ids=rids[:MAX_CANCELS]
        )
        try:
            r = await self.peers.http.post(f"{url}/internal/cancel", json=body.model_dump(), timeout=5.0)
            if r.status_code != 200:
                return []
            return CancelReply.model_validate(r.json()).settled
        except (httpx.HTTPError, ValueError):
            return []  # asked again next round

    async def _gone(self, url: str, instance: str) -> bool:
        try:
            r = await self.peers.http.get(f"{url}/internal/agent", timeout=2.0)
        except httpx.ConnectError:
            return True  # nothing listens at its address: the process is gone
        except httpx.HTTPError:
            return False
        if r.status_code != 200:
            return False
        try:
            body = r.json()
        except ValueError:
            return False
        return body.get("instance_id") != instance or body.get("engine_alive") is False


def _agent(state: WorkerState) -> AgentInfo:
    assert state.agent is not None  # the routes that use it answer only once the engine was ready
    return state.agent


def _error_text(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except Exception:
        return f"HTTP {r.status_code}"


async def _remote_prefill(
    state: WorkerState,
    peers: PrefillPeers,
    url: str,
    gen: GenerateRequest,
    pages: list[int],
    timeout_s: float,
    trace: WorkerTrace | None = None,
) -> None:
    """Asks the prefill peer at `url` (a known one: PeerDirectory) to fill `pages`; tells the engine when that cannot happen, and whether the peer
    may have started (then the pages wait for its word)."""
    client = state.client
    assert client is not None
    try:
        for attempt in range(2):
            hs = await peers.ensure(url, force=attempt > 0)
            try:
                await client.call(PrefillSending(gen.req_id, hs.agent_name, hs.instance_id))
            except EngineError as e:
                if e.code == ENGINE_TIMEOUT:  # the ids have not left: nothing can be written into the pages
                    raise PeerFailure(f"could not start the remote prefill: {e}", started=False) from None
                return  # given up meanwhile: the page ids never leave this worker
            agent = _agent(state)
            body = PrefillRequest(
                req_id=gen.req_id,
                token_ids=gen.token_ids,
                sampling=gen.sampling,
                dst_agent=agent.agent_name,
                dst_instance_id=agent.instance_id,
                dst_pages=pages,
                deadline_s=timeout_s,
            )
            if trace is not None:
                trace.mark("prefill_requested")
            try:
                async with peers.http.stream(
                    "POST",
                    f"{url}/internal/prefill",
                    json=body.model_dump(),
                    headers=trace.headers() if trace is not None else None,
                    timeout=httpx.Timeout(10.0, read=PREFILL_HEAD_S),
                ) as r:
                    if r.status_code == 409 and attempt == 0:
                        # The peer restarted and lost our handshake; it registered nothing: redo it once.
                        await client.call(PrefillRefused(gen.req_id))
                        continue
                    if r.status_code != 200:
                        await r.aread()
                        raise PeerFailure(
                            f"prefill worker {url} refused the request: {_error_text(r)}",
                            started=r.status_code not in REFUSALS,
                        )
                    lines = r.aiter_lines()
                    while True:
                        try:
                            async with asyncio.timeout(PREFILL_STALL_S):
                                line = await anext(lines)
                        except StopAsyncIteration:
                            break
                        except TimeoutError:
                            raise PeerFailure(
                                f"prefill worker {url} showed no progress for {PREFILL_STALL_S:g}s", started=True
                            ) from None
                        if not line:
                            continue
                        msg = PrefillProgress.model_validate_json(line)  # ValidationError is a ValueError
                        if msg.error is not None:
                            raise PeerFailure(f"prefill failed: {msg.error}", started=True)
                        if msg.done:
                            return
                    raise PeerFailure(f"prefill worker {url} closed the stream before finishing", started=True)
            except httpx.ConnectError as e:
                raise PeerFailure(f"prefill worker {url} unreachable: {e!r}", started=False) from None
            except (httpx.HTTPError, ValueError) as e:
                raise PeerFailure(f"prefill worker {url} failed: {e!r}", started=True) from None
    except PeerFailure as e:
        peers.known.pop(url, None)
        client.cast(PrefillFailed(gen.req_id, str(e), e.started))
    except asyncio.CancelledError:
        return


def add_decode_routes(app: FastAPI, state: WorkerState) -> None:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    http = httpx.AsyncClient(limits=limits, headers=state.cfg.internal_token.headers())  # peers' /internal/*
    peers = PrefillPeers(state, http)
    directory = PeerDirectory(state.cfg.prefill_peers)
    if not state.cfg.prefill_peers:
        log.warning(
            "no prefill peers configured: disaggregated requests will be refused (403 unknown_prefill_peer) and "
            "the router prefills them on this worker; set KVFERRY_PREFILL_PEERS to the prefill workers' URLs "
            "(in Kubernetes the headless Service, e.g. http://kvferry-prefill:8100)"
        )
    watch = PeerWatch(state, peers)
    state.event_handlers[AwaitingPeers] = watch.update
    state.on_engine_lost.append(lambda: (peers.known.clear(), watch.awaited.clear()))  # a new agent handshakes anew
    state.event_handlers[KVForcedRelease] = lambda ev: state.metrics.kv_forced_releases.inc(ev.requests)
    reservations: dict[str, asyncio.Future[list[int]]] = {}

    def on_reserved(ev: Reserved) -> None:
        fut = reservations.get(ev.req_id)
        if fut is not None and not fut.done():
            fut.set_result(ev.pages)

    state.event_handlers[Reserved] = on_reserved

    @app.post("/internal/generate")
    async def generate(request: Request) -> Response:
        gen: GenerateRequest = await read_message(request, GenerateRequest)
        if not state.ready:
            return error_response(503, "decode worker not ready", "unavailable", "not_ready")
        client = state.client
        assert client is not None
        peer_url = None
        if gen.prefill_url is not None:
            peer_url = await directory.resolve(gen.prefill_url)
            if peer_url is None:
                message = f"prefill worker {gen.prefill_url!r} is not among this worker's KVFERRY_PREFILL_PEERS"
                if not state.cfg.prefill_peers:
                    message += " (unset: set KVFERRY_PREFILL_PEERS to the prefill workers' URLs to accept it)"
                else:
                    message += " (add it to KVFERRY_PREFILL_PEERS to accept it)"
                return error_response(403, message, "invalid_request_error", "unknown_prefill_peer")
        if gen.req_id in client.streams:  # delivered twice: the live copy keeps its stream
            message = f"duplicate request id {gen.req_id!r}"
            return error_response(409, message, "invalid_request_error", "duplicate_request")
        queue = client.open_stream(gen.req_id)
        state.live.add(gen.req_id)
        remote = gen.prefill_url is not None
        trace = WorkerTrace(
            "decode generate", gen.req_id, request.headers.get("traceparent"), {"kvferry.remote": remote}
        )
        timeout_s = gen.kv_timeout_s or PREFILL_DEADLINE_S
        if remote:
            reservations[gen.req_id] = asyncio.get_running_loop().create_future()
        prefill_task: asyncio.Task[None] | None = None
        finished = False
        ended = False

        def end(abort: bool) -> None:
            """Lets go of everything the request holds here, at once (no await: nothing can interrupt it);
            idempotent. ``abort``: the engine may still hold the request (its caller went away): stop it,
            which frees its pages (or, after a remote prefill began, holds them until the peer's word)."""
            nonlocal ended
            if ended:
                return
            ended = True
            state.live.discard(gen.req_id)
            state.accepted.ended(gen.req_id)
            client.close_stream(gen.req_id)
            reservations.pop(gen.req_id, None)
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
            if abort:
                client.cast(Abort(gen.req_id))

        try:
            await client.call(
                Generate(gen.req_id, gen.token_ids, gen.sampling.model_dump(), remote, timeout_s, trace.received)
            )
        except BaseException as exc:
            # The engine may still take the request (a late answer, or the caller left): stop it then.
            end(abort=not isinstance(exc, EngineError) or exc.code == ENGINE_TIMEOUT)
            raise
        state.metrics.prompt.inc(len(gen.token_ids))
        state.accepted.add(gen.req_id, len(gen.token_ids), prefill_here=not remote)

        async def arrange_prefill(reserved: asyncio.Future[list[int]]) -> None:
            try:
                pages = await reserved
            finally:
                reservations.pop(gen.req_id, None)
            await _remote_prefill(state, peers, peer_url, gen, pages, timeout_s, trace)

        if remote:
            prefill_task = asyncio.create_task(arrange_prefill(reservations[gen.req_id]))

        async def stream() -> AsyncIterator[bytes]:
            nonlocal finished
            while not finished:
                ev = await queue.get()
                if not isinstance(ev, Tokens):  # a decode stream's only event
                    continue
                item = ev.stream_item()
                state.metrics.generated.inc(len(ev.token_ids))
                if ev.cached_tokens is not None:
                    state.metrics.cached.inc(ev.cached_tokens)
                if ev.finish_reason:
                    finished = True
                    state.observe_finish(ev.finish_reason)
                timeline = item.get("timeline")
                if timeline is not None:  # the first tokens: the stages so far, passed on to the router
                    timeline.update(trace.stamps)
                    timeline["first_token_sent"] = time.time()
                    trace.stamps = timeline
                    state.metrics.engine.observe_decode_timeline(timeline)
                yield (json.dumps(item) + "\n").encode()

        async def on_close() -> None:
            # However the response ended: streamed to its finish, or the caller gone at any moment (Starlette
            # cancels the stream when it sees the disconnect, even before the stream's first step).
            end(abort=not finished)
            trace.end(DECODE_SPANS, error=None if finished else "the caller went away")
            if not finished:
                state.metrics.requests.labels(outcome="abort").inc()

        return ManagedStream(stream(), on_close, "application/x-ndjson")

    @app.post("/internal/abort")
    async def abort(request: Request) -> Response:
        ab: AbortRequest = await read_message(request, AbortRequest)
        assert state.client is not None
        state.client.cast(Abort(ab.req_id))
        return Response(status_code=204)
