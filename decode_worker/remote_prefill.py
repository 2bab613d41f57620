"""The decode side of a remote prefill (``RemotePrefill``): the engine's reservation, the handshake, the peer's
`/internal/prefill` stream, and the watch of peers that may still write into pages given up here.

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
import logging
import time
from dataclasses import dataclass, field

import httpx

from common.protocol import (
    MAX_CANCELS,
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
from common.serving.messages import (
    AgentInfo,
    AwaitingPeers,
    PeerGone,
    PrefillFailed,
    PrefillRefused,
    PrefillSending,
    Reserved,
    TransfersSettled,
)
from common.serving.request_trace import WorkerTrace
from common.serving.worker_state import WorkerState

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


class RemotePrefill:
    """Every remote prefill of this worker: one per request (``expect`` before the engine is asked to reserve,
    then ``start``), over one HTTP client, one set of handshakes and one ``PeerWatch``."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        http = httpx.AsyncClient(limits=limits, headers=state.cfg.internal_token.headers())  # peers' /internal/*
        self.peers = PrefillPeers(state, http)
        self.watch = PeerWatch(state, self.peers)
        self.reservations: dict[str, asyncio.Future[list[int]]] = {}
        state.event_handlers[AwaitingPeers] = self.watch.update
        state.event_handlers[Reserved] = self._on_reserved
        state.on_engine_lost.append(self._engine_lost)

    def _engine_lost(self) -> None:
        self.peers.known.clear()  # a new agent handshakes anew
        self.watch.awaited.clear()

    def _on_reserved(self, ev: Reserved) -> None:
        fut = self.reservations.get(ev.req_id)
        if fut is not None and not fut.done():
            fut.set_result(ev.pages)

    def expect(self, req_id: str) -> None:
        """Called before the engine is asked to reserve: its ``Reserved`` event may come with its reply."""
        self.reservations[req_id] = asyncio.get_running_loop().create_future()

    def forget(self, req_id: str) -> None:
        self.reservations.pop(req_id, None)

    def start(self, gen: GenerateRequest, url: str, timeout_s: float, trace: WorkerTrace) -> asyncio.Task[None]:
        """Once the pages are reserved, asks the peer at ``url`` to fill them (``_remote_prefill``)."""
        reserved = self.reservations[gen.req_id]

        async def run() -> None:
            try:
                pages = await reserved
            finally:
                self.forget(gen.req_id)
            await _remote_prefill(self.state, self.peers, url, gen, pages, timeout_s, trace)

        return asyncio.create_task(run())
