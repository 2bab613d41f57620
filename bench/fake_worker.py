"""A zero-cost worker for benchmarking the router alone (bench/router.py): it speaks the worker HTTP
contract (``/ready``, ``/health``, ``/load``, NDJSON ``/internal/generate``) from a token script with no
model, so the router's added latency is measured without model time in the noise. Benchmarks only: the
tests run real workers.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

__all__ = ["StubBehaviour", "StubWorker"]


@dataclass
class StubBehaviour:
    script: list[int] = field(default_factory=lambda: [100, 101, 102, 103])  # tokens emitted, cycled
    eos_id: int | None = None  # emitted after the script once (finish "stop") when set
    tokens_per_event: int = 1
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    fail_status: int | None = None  # answer generate requests with this status...
    fail_count: int = 0  # ...for this many requests (then behave)
    error_event_count: int = 0  # requests answered with an "error" finish before any token
    hang: bool = False  # accept and never send anything (like a SIGSTOPped pod)
    stall_after: int | None = None  # stop sending (without closing) after this many tokens
    break_after: int | None = None  # drop the connection mid-body after this many tokens (a crash)
    load_hang: bool = False  # /load never answers (a pod too busy, or frozen, to answer its health polls)
    ready: bool = True
    draining: bool = False
    cached_tokens: int = 0
    queued_prefill_tokens: int = 0
    running_requests: int = 0
    free_pages: int = 1000
    total_pages: int = 1000
    page_size: int = 16


class StubWorker:
    def __init__(self, role: str, pod: str, behaviour: StubBehaviour | None = None) -> None:
        self.role = role
        self.pod = pod
        self.b = behaviour or StubBehaviour()
        self.received: list[dict[str, Any]] = []
        self.active = 0
        self.aborted = 0
        self.completed = 0
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/ready")
        async def ready() -> Response:
            ok = self.b.ready and not self.b.draining
            return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

        @app.get("/load")
        async def load() -> dict[str, Any]:
            b = self.b
            while b.load_hang:
                await asyncio.sleep(0.05)
            return {
                "role": self.role,
                "pod": self.pod,
                "queued_prefill_tokens": b.queued_prefill_tokens,
                "running_requests": b.running_requests + self.active,
                "waiting_requests": 0,
                "free_pages": b.free_pages,
                "total_pages": b.total_pages,
                "page_size": b.page_size,
                "ready": b.ready,
                "draining": b.draining,
            }

        @app.post("/internal/generate")
        async def generate(request: Request) -> Response:
            body = json.loads(await request.body())
            self.received.append(body)
            b = self.b
            if b.fail_status is not None and b.fail_count > 0:
                b.fail_count -= 1
                return JSONResponse(
                    {"error": {"message": f"stub failure {b.fail_status}", "type": "stub", "code": "stub"}},
                    status_code=b.fail_status,
                )
            if not b.ready or b.draining:
                return JSONResponse({"error": {"message": "not ready", "type": "unavailable"}}, status_code=503)
            return StreamingResponse(self._events(body), media_type="application/x-ndjson")

        return app

    async def _events(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        b = self.b
        sp = body["sampling"]
        prompt = body["token_ids"]
        max_tokens = int(sp.get("max_tokens", 16))
        stop_ids = set(sp.get("stop_token_ids") or [])
        want_lp = bool(sp.get("logprobs")) or int(sp.get("top_logprobs", 0)) > 0
        n_top = int(sp.get("top_logprobs", 0))
        greedy = float(sp.get("temperature", 1.0)) == 0.0 or int(sp.get("top_k", -1)) == 1
        rng = random.Random(sp.get("seed") if sp.get("seed") is not None else time.monotonic_ns())
        self.active += 1
        finished = False
        try:
            if b.hang:
                await asyncio.sleep(3600)
            if b.first_token_delay_s:
                await asyncio.sleep(b.first_token_delay_s)
            if b.error_event_count > 0:
                b.error_event_count -= 1
                finished = True
                yield (
                    json.dumps({"token_ids": [], "finish_reason": "error", "error": "stub prefill failed"}) + "\n"
                ).encode()
                return
            produced = 0
            first = True
            while True:
                batch: list[int] = []
                lps: list[dict[str, Any]] = []
                reason = None
                while len(batch) < b.tokens_per_event:
                    if greedy:
                        tok = b.script[produced % len(b.script)]
                        if b.eos_id is not None and produced == len(b.script):
                            tok = b.eos_id
                    else:
                        tok = b.script[rng.randrange(len(b.script))]
                    produced += 1
                    batch.append(tok)
                    lps.append({"logprob": -0.25, "top": [[tok + k, -0.25 - k] for k in range(n_top)]})
                    if tok in stop_ids or tok == b.eos_id:
                        reason = "stop"
                    elif produced >= max_tokens:
                        reason = "length"
                    if reason:
                        break
                ev: dict[str, Any] = {"token_ids": batch}
                if want_lp:
                    ev["logprobs"] = lps
                if first:
                    ev["prompt_tokens"] = len(prompt)
                    ev["cached_tokens"] = min(b.cached_tokens, len(prompt))
                    first = False
                if reason:
                    ev["finish_reason"] = reason
                yield (json.dumps(ev) + "\n").encode()
                if reason:
                    finished = True
                    return
                if b.stall_after is not None and produced >= b.stall_after:
                    await asyncio.sleep(3600)
                if b.break_after is not None and produced >= b.break_after:
                    raise ConnectionAbortedError("stub worker crashed mid-stream")
                if b.token_delay_s:
                    await asyncio.sleep(b.token_delay_s)
                else:
                    await asyncio.sleep(0)
        finally:
            self.active -= 1
            if finished:
                self.completed += 1
            else:
                self.aborted += 1


def main(argv: list[str] | None = None) -> int:
    """``python bench/fake_worker.py --role decode --port P --pod NAME``: a stub worker process (tests
    that need a real process to stop with SIGSTOP, benchmarks)."""
    import argparse

    p = argparse.ArgumentParser(prog="python bench/fake_worker.py")
    p.add_argument("--role", choices=["prefill", "decode"], default="decode")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--pod", default="")
    p.add_argument("--token-delay-s", type=float, default=0.0)
    args = p.parse_args(argv)
    worker = StubWorker(
        args.role, args.pod or f"stub-{args.role}-{args.port}", StubBehaviour(token_delay_s=args.token_delay_s)
    )
    uvicorn.run(worker.app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
