"""The decode side of a remote prefill: one ``PrefillCall`` per request, over ``RemotePrefill``'s HTTP client and
handshakes.

A request with a prefill peer is handshaken with that peer first (once per peer instance); then one engine call
(``Generate`` naming the peer) reserves its pages, and its reply carries them: the leave to send them to that
peer. The call then asks the peer (`POST /internal/prefill`) to fill them.

The two workers learn of each other one way each:

- the KV's completion is the peer's NIXL notice, read by the engine (decode_worker/engine.py): "landed"
  admits the request, "closed" (the peer gave it up once its writes settled) fails it and frees its pages;
- the peer's liveness is the request's `/internal/prefill` exchange. It stays open, with a heartbeat line at
  least every second while the peer's engine works, until the peer's session of the request is over (its
  last line, sent after the notice), also after this side gave the request up (the peer is then sent one
  cancel). How it ends says whether a write may still come:
  - a refusal (nothing registered there; not a duplicate of a registration to this worker), a connection that never carried the request, a break of the
    stream (the peer's process is gone) or a last line saying the peer's engine exited: no write of the
    request can come; the engine is told (``PrefillSettled``) and frees the pages, failing the request if it
    still waited;
  - no line for ``PREFILL_STALL_S`` (a frozen or partitioned peer) or an answer that says nothing of that:
    the request fails (``PrefillFailed``); its pages stay held until the peer's notice, or the engine's
    last-resort deadline (common/transfer/session.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from common.protocol import (
    CancelTransfers,
    DecodeError,
    GenerateRequest,
    HandshakeRequest,
    HandshakeResponse,
    PrefillProgress,
    PrefillRequest,
    decode,
    encode,
)
from common.worker.messages import AgentInfo, PrefillFailed, PrefillSettled
from common.worker.request_trace import WorkerTrace
from common.worker.worker_state import WorkerState

log = logging.getLogger("kvferry.decode")

# A remote prefill is given up when it stops making progress, not after a fixed time: the prefill worker sends a
# progress line at least every second while its engine works (prefill_worker/routes.py), so a long prompt on a busy
# CPU may take minutes while a dead or frozen peer is noticed within PREFILL_STALL_S.
PREFILL_STALL_S = 15.0
JSON_BODY = {"content-type": "application/json"}
PREFILL_HEAD_S = 45.0  # the peer's answer to the prefill request: its engine call may take up to 30 s
# Outer bound of a remote prefill and its KV transfer however it progresses (GenerateRequest.kv_timeout_s
# overrides it); kept under the transfer sessions' 300 s safety deadline (common/transfer/session.py).
PREFILL_DEADLINE_S = 240.0
# Answers of a prefill worker that registered nothing (so it writes nothing): bad request, unknown peer
# (handshake again) or a request id another worker's request holds there, cancelled before it arrived, queue full,
# not ready. Not a 409 duplicate_request: the same request is on its way to this worker from there already.
REFUSALS = frozenset({400, 409, 410, 429, 503})
# The exchange broke (the peer's process closed it, or never took the request): no write of the request follows.
BROKEN = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.ReadError, httpx.WriteError)


# Answers of a live prefill worker too busy to take the request now (its engine answered too late, its queue is
# full): overload, not a fault; the router tries elsewhere and, if nothing takes it, answers 429.
OVERLOADED = frozenset({(504, "engine_timeout"), (429, None)})


class PeerFailure(RuntimeError):
    def __init__(self, message: str, settled: bool, overloaded: bool = False) -> None:
        super().__init__(message)
        self.settled = settled  # no write of the request can come any more
        self.overloaded = overloaded  # the peer is alive but too busy (`OVERLOADED`)


def overloaded_answer(r: httpx.Response) -> bool:
    code = _error_code(r)
    return (r.status_code, code) in OVERLOADED or (r.status_code, None) in OVERLOADED


@dataclass
class PrefillCall:
    """One request's remote prefill, from its reserved pages to the end of its exchange with the peer."""

    gen: GenerateRequest
    url: str
    peer: HandshakeResponse  # the peer instance the pages were reserved for
    pages: list[int]
    timeout_s: float
    trace: WorkerTrace
    sent: bool = False  # the request may have reached the peer
    given_up: bool = False  # this side no longer wants the KV
    failed: bool = False  # the engine was told the request failed
    task: asyncio.Task[None] | None = None


@dataclass
class RemotePrefill:
    """Every remote prefill of this worker (``handshake``, then ``start`` with the reserved pages, ``give_up``),
    over one HTTP client and one set of handshakes (by peer URL; a peer that restarted is handshaken again)."""

    state: WorkerState
    http: httpx.AsyncClient
    calls: dict[str, PrefillCall] = field(default_factory=dict)
    known: dict[str, HandshakeResponse] = field(default_factory=dict)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # Requests whose remote prefill failed only because the peer was too busy; their error event says so
    # (decode_worker/routes.py), so the router answers 429 rather than a 5xx if no other worker takes them.
    overloaded: set[str] = field(default_factory=set)

    @classmethod
    def create(cls, state: WorkerState) -> RemotePrefill:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        http = httpx.AsyncClient(limits=limits, headers=state.cfg.internal_token.headers())  # peers' /internal/*
        remote = cls(state, http)
        state.on_engine_lost.append(remote._engine_lost)
        return remote

    def start(
        self,
        gen: GenerateRequest,
        url: str,
        peer: HandshakeResponse,
        pages: list[int],
        timeout_s: float,
        trace: WorkerTrace,
    ) -> None:
        """The engine reserved ``pages`` for the request and gave leave to send them to ``peer``: asks it to fill them."""
        call = self.calls[gen.req_id] = PrefillCall(gen, url, peer, pages, timeout_s, trace)
        call.task = asyncio.create_task(self._run(call))

    def give_up(self, req_id: str) -> None:
        """This side no longer wants the request's KV. Before the request went out the call just stops, and the
        engine learns that no write can come; after, the peer is asked to cancel and the exchange is read on to
        its end."""
        call = self.calls.get(req_id)
        if call is None or call.given_up:
            return
        call.given_up = True
        if call.sent:
            asyncio.get_running_loop().create_task(self._cancel(call))
            return
        assert call.task is not None and self.state.client is not None
        call.task.cancel()
        del self.calls[req_id]
        self.state.client.cast(PrefillSettled(req_id, "given up before the prefill request was sent"))

    def _engine_lost(self) -> None:
        self.known.clear()  # a new agent handshakes anew
        for call in self.calls.values():
            if call.task is not None:
                call.task.cancel()  # closing an exchange makes its peer abort the request
        self.calls.clear()

    # ---- one call ----------------------------------------------------------------------------------------
    async def _run(self, call: PrefillCall) -> None:
        client = self.state.client
        assert client is not None
        rid = call.gen.req_id
        try:
            await self._exchange(call)
        except PeerFailure as e:
            self.known.pop(call.url, None)
            if e.overloaded and not call.given_up:
                self.overloaded.add(rid)
            client.cast(PrefillSettled(rid, str(e)) if e.settled else PrefillFailed(rid, str(e)))
        finally:
            if self.calls.get(rid) is call:
                del self.calls[rid]

    async def _exchange(self, call: PrefillCall) -> None:
        gen, agent = call.gen, _agent(self.state)
        body = PrefillRequest(
            req_id=gen.req_id,
            token_ids=gen.token_ids,
            sampling=gen.sampling,
            dst_agent=agent.agent_name,
            dst_instance_id=agent.instance_id,
            dst_pages=call.pages,
            deadline_s=call.timeout_s,
        )
        for attempt in range(2):
            call.trace.mark("prefill_requested")
            call.sent = True
            try:
                async with self.http.stream(
                    "POST",
                    f"{call.url}/internal/prefill",
                    content=encode(body),
                    headers={**call.trace.headers(), **JSON_BODY},
                    timeout=httpx.Timeout(10.0, read=PREFILL_HEAD_S),
                ) as r:
                    if r.status_code != 200:
                        await r.aread()
                    code = _error_code(r) if r.status_code != 200 else None
                    if code == "unknown_peer" and attempt == 0 and not call.given_up:
                        # The peer restarted and lost our handshake; it registered nothing. The same pages go
                        # to its new instance (the same name and address) after a new handshake.
                        call.sent = False
                        await self.handshake(call.url, force=True)
                        continue
                    if r.status_code != 200:
                        # duplicate_request: an earlier registration of this request to this worker is live
                        # there and owns its notice, which may yet write: this call fails, its pages held.
                        raise PeerFailure(
                            f"prefill worker {call.url} refused the request: {_error_text(r)}",
                            settled=r.status_code in REFUSALS and code != "duplicate_request",
                            overloaded=overloaded_answer(r),
                        )
                    await self._read(call, r)
                    return
            except httpx.RemoteProtocolError as e:  # the peer closed the connection before its last line
                raise PeerFailure(f"prefill worker {call.url} is gone: {e!r}", settled=True) from None
            except BROKEN as e:
                raise PeerFailure(f"prefill worker {call.url} unreachable: {e!r}", settled=True) from None
            except (httpx.HTTPError, ValueError, DecodeError) as e:
                raise PeerFailure(f"prefill worker {call.url} failed: {e!r}", settled=False) from None

    async def _read(self, call: PrefillCall, r: httpx.Response) -> None:
        """The exchange's lines up to its last: its heartbeats keep the request waiting; one missing for
        ``PREFILL_STALL_S`` fails it, and the exchange is read on (its end still tells whether a write may come)."""
        client = self.state.client
        assert client is not None
        lines = r.aiter_lines()
        while True:
            try:
                async with asyncio.timeout(None if call.given_up or call.failed else PREFILL_STALL_S):
                    line = await anext(lines)
            except StopAsyncIteration:  # a live peer ends its exchange with its last line only
                raise PeerFailure(
                    f"prefill worker {call.url} is gone: it closed the stream early", settled=True
                ) from None
            except TimeoutError:
                if not call.given_up and not call.failed:
                    call.failed = True
                    error = f"prefill worker {call.url} showed no progress for {PREFILL_STALL_S:g}s"
                    client.cast(PrefillFailed(call.gen.req_id, error))
                continue
            if not line:
                continue
            msg = decode(line, PrefillProgress)
            if msg.engine_exited:
                raise PeerFailure(f"prefill failed: {msg.error}", settled=True)
            if msg.done or msg.error is not None:
                return  # the peer's session is over; its notice (sent first) tells the engine how

    async def _cancel(self, call: PrefillCall) -> None:
        """Tells the peer this side gave the request up: it aborts it, or refuses it should it arrive later."""
        agent = _agent(self.state)
        body = CancelTransfers(dst_agent=agent.agent_name, dst_instance_id=agent.instance_id, req_ids=[call.gen.req_id])
        try:
            await self.http.post(f"{call.url}/internal/cancel", content=encode(body), headers=JSON_BODY, timeout=5.0)
        except httpx.HTTPError:
            pass  # the exchange's end still says how the request ended there

    async def handshake(self, url: str, force: bool = False) -> HandshakeResponse:
        """The peer at ``url`` as this worker's agent knows it (handshaken once per peer instance); raises
        ``PeerFailure``."""
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
                layout=agent.layout,
            )
            started = time.perf_counter()
            try:
                r = await self.http.post(
                    f"{url}/internal/handshake", content=encode(body), headers=JSON_BODY, timeout=10.0
                )
            except httpx.HTTPError as e:
                raise PeerFailure(f"handshake with prefill worker {url} failed: {e!r}", settled=True) from None
            if r.status_code != 200:
                raise PeerFailure(
                    f"prefill worker {url} refused the handshake: {_error_text(r)}",
                    settled=True,
                    overloaded=overloaded_answer(r),
                )
            try:
                resp = decode(r.content, HandshakeResponse)
            except DecodeError as e:
                raise PeerFailure(f"prefill worker {url} sent a bad handshake: {e}", settled=True) from None
            self.known[url] = resp
            self.state.metrics.engine.handshake.observe(time.perf_counter() - started)
            return resp


def _agent(state: WorkerState) -> AgentInfo:
    assert state.agent is not None  # the routes that use it answer only once the engine was ready
    return state.agent


def _error_code(r: httpx.Response) -> str | None:
    try:
        return str(r.json()["error"]["code"])
    except Exception:
        return None


def _error_text(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except Exception:
        return f"HTTP {r.status_code}"
