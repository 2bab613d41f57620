"""The decode role's control plane: `/internal/generate` streams token ids (``DecodeStream``, one per request); a
remote prefill is arranged by decode_worker/remote_prefill.py."""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from common.protocol import GenerateRequest, HandshakeResponse, SamplingParams, TokenLine, replace
from common.worker.http_errors import error_response
from common.worker.messages import Generate, KVForcedRelease, PrefillSettled, Reserved, StreamEvent, Tokens
from common.worker.request import WorkerRequest, read_when_ready
from common.worker.request_trace import DECODE_SPANS, WorkerTrace
from common.worker.worker_state import WorkerState
from decode_worker.peer_directory import PeerDirectory
from decode_worker.remote_prefill import PREFILL_DEADLINE_S, PeerFailure, RemotePrefill

log = logging.getLogger("kvferry.decode")


class DecodeStream(WorkerRequest):
    """One generate request on this worker: its token lines for the router; with a prefill peer, the handshake
    and, once the engine reserved the pages, the peer asked to fill them (decode_worker/remote_prefill.py)."""

    spans = DECODE_SPANS
    gone = "the caller went away"

    def __init__(
        self, state: WorkerState, remote: RemotePrefill, gen: GenerateRequest, peer_url: str | None, trace: WorkerTrace
    ) -> None:
        super().__init__(state, gen.req_id, trace)
        self.remote = remote
        self.gen = gen
        self.peer_url = peer_url  # the prefill peer, or None: prefilled here
        self.landed = False  # tokens came: the prompt's KV is here (a remote prefill is over)
        self.peer: HandshakeResponse | None = None  # the prefill peer's agent, once handshaken
        self.asked = False  # the peer was asked to fill the reserved pages (`reserved`)

    async def begin(self) -> None:
        """Hands the request to the engine, which queues it and answers at once; with a peer, the pages it
        reserves come later as a ``Reserved`` event on the stream (`line`), and the peer is then asked to fill
        them. A caller that leaves while they wait is heard at once."""
        gen, rid = self.gen, self.req_id
        if self.peer_url is not None:
            try:
                self.peer = await self.remote.handshake(self.peer_url)
            except PeerFailure as e:  # the stream says so; the router tries another prefill worker
                if e.overloaded:
                    self.remote.overloaded.add(rid)
                self.queue.put_nowait(Tokens(rid, TokenLine(finish_reason="error", error=str(e))))
                return
        peer = self.peer
        names = (peer.agent_name, peer.instance_id) if peer is not None else (None, None)
        cmd = Generate(rid, gen.token_ids, self._sampling(), *names, self.kv_timeout_s, self.trace.received)
        await self.submit(cmd, len(gen.token_ids), prefill_here=peer is None)
        self.state.decodes_accepted += 1

    def _sampling(self) -> SamplingParams:
        """The request's sampling, its ITL allowance (the router's relay lateness) raised by this process's own."""
        sampling = self.gen.sampling
        if not self.state.cfg.relay_allowance:
            return sampling
        lag = self.state.relay_lag
        lag.start()  # timed from the first stream on: a prefill-only worker never runs the timer
        return lag.add_to(sampling)

    @property
    def kv_timeout_s(self) -> float:
        return self.gen.kv_timeout_s or PREFILL_DEADLINE_S

    def reserved(self, ev: Reserved) -> None:
        """The engine reserved the request's pages for its peer: the peer is asked to fill them."""
        if self.ended or self.peer is None or self.peer_url is None:
            return  # let go of already: the engine's abort frees them
        self.asked = True
        self.remote.start(self.gen, self.peer_url, self.peer, ev.pages, self.kv_timeout_s, self.trace)

    def let_go(self, abort: bool) -> None:
        # After a remote prefill began, the engine's abort holds the pages until the peer's word.
        self.remote.overloaded.discard(self.req_id)
        if not self.landed:
            self.remote.give_up(self.req_id)
        super().let_go(abort)
        if abort and self.peer is not None and not self.asked:
            # Pages the engine reserved meanwhile were never sent: nothing can write them, free them now.
            self.client.cast(PrefillSettled(self.req_id, "the prefill request was never sent"))

    def line(self, ev: StreamEvent) -> TokenLine | None:
        if isinstance(ev, Reserved):
            self.reserved(ev)
            return None
        if not isinstance(ev, Tokens):
            return None
        metrics = self.state.metrics
        line = ev.line
        if line.finish_reason == "error" and not self.landed and ev.req_id in self.remote.overloaded:
            line = replace(line, overloaded=True)  # its prefill worker was only too busy: the router's 429
        self.landed = self.landed or bool(line.token_ids)
        metrics.generated.inc(len(line.token_ids))
        metrics.cached.inc(line.cached_tokens)
        if line.finish_reason:
            self.finished = True
            self.state.observe_finish(line.finish_reason)
        timeline = line.timeline
        if timeline is not None:  # the first tokens: the stages so far, passed on to the router
            timeline.update(self.trace.stamps)
            timeline["first_token_sent"] = time.time()
            self.trace.stamps = timeline
            metrics.engine.observe_decode_timeline(timeline)
        return line


def _over_share(state: WorkerState, gen: GenerateRequest) -> str | None:
    """Why the request may not reserve its KV here (more than one request's share of the pool), or None. The
    router admits by the same figure (router/admission.py); this is for callers that bypass it."""
    load = state.load
    cap = state.max_request_tokens(load.total_pages) if load is not None else 0
    need = len(gen.token_ids) + gen.sampling.max_tokens
    if cap <= 0 or need <= cap:
        return None
    return (
        f"the request needs {need} tokens of KV memory (prompt {len(gen.token_ids)} + max_tokens "
        f"{gen.sampling.max_tokens}); one request may take at most {cap} tokens on this worker "
        f"(KVFERRY_MAX_REQUEST_KV_SHARE={state.cfg.max_request_kv_share:g} of its KV pool)"
    )


def add_decode_routes(app: FastAPI, state: WorkerState) -> None:
    remote = RemotePrefill.create(state)
    directory = PeerDirectory(state.cfg.prefill_peers)
    if not state.cfg.prefill_peers:
        log.warning(
            "no prefill peers configured: disaggregated requests will be refused (403 unknown_prefill_peer) and "
            "the router prefills them on this worker; set KVFERRY_PREFILL_PEERS to the prefill workers' URLs "
            "(in Kubernetes the headless Service, e.g. http://kvferry-prefill:8100)"
        )
    state.event_handlers[KVForcedRelease] = lambda ev: state.metrics.kv_forced_releases.inc(ev.requests)

    @app.post("/internal/generate")
    async def generate(request: Request) -> Response:
        gen = await read_when_ready(request, state, GenerateRequest)
        if isinstance(gen, Response):
            return gen
        too_large = _over_share(state, gen)
        if too_large is not None:
            return error_response(400, too_large, "invalid_request_error", "request_too_large")
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
        if gen.req_id in state.requests:  # delivered twice: the live copy keeps its stream
            message = f"duplicate request id {gen.req_id!r}"
            return error_response(409, message, "invalid_request_error", "duplicate_request")
        attrs = {"kvferry.remote": peer_url is not None}
        trace = WorkerTrace("decode generate", gen.req_id, request.headers.get("traceparent"), attrs)
        stream = DecodeStream(state, remote, gen, peer_url, trace)
        await stream.begin()
        return stream.response()
