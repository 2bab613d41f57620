"""A zero-cost decode/prefill worker for benchmarking the router alone (bench/router.py).

It speaks the worker HTTP contract (``GET /health|/ready|/load``, NDJSON ``POST /internal/generate``)
with no model, so the router's cost is measured without model time in the noise. Like a real engine it
works in steps: every ``step_s`` each open stream gets one event (``tokens_per_event`` token ids), all
streams' events written in the same loop turn; ``step_s`` 0 answers a request's whole stream at once.
It is a bare asyncio protocol (uvloop when installed) rather than an ASGI app, so one process can feed
a router tens of thousands of events a second without being the bottleneck. Benchmarks only: the tests
run real workers.

    python bench/fake_worker.py --port 8200 --step-s 0.02
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field

__all__ = ["FakeWorker", "main"]

_SCRIPT = (100, 101, 102, 103)  # token ids emitted, cycled


@dataclass(eq=False)
class _Stream:
    transport: asyncio.Transport
    max_tokens: int
    prompt_tokens: int
    produced: int = 0


@dataclass
class FakeWorker:
    role: str
    pod: str
    step_s: float = 0.0
    tokens_per_event: int = 1
    streams: set[_Stream] = field(default_factory=set)
    served: int = 0

    def load_body(self) -> bytes:
        return json.dumps(
            {
                "role": self.role,
                "pod": self.pod,
                "queued_prefill_tokens": 0,
                "running_requests": len(self.streams),
                "waiting_requests": 0,
                "free_pages": 100_000,
                "total_pages": 100_000,
                "page_size": 16,
                "ready": True,
                "draining": False,
                "max_running": 100_000,
            }
        ).encode()

    def event(self, s: _Stream) -> bytes:
        """The stream's next event as one HTTP chunk (the last one also ends the chunked body)."""
        n = min(self.tokens_per_event, s.max_tokens - s.produced)
        ids = [_SCRIPT[(s.produced + k) % len(_SCRIPT)] for k in range(n)]
        ev: dict[str, object] = {"token_ids": ids}
        if s.produced == 0:
            ev["prompt_tokens"] = s.prompt_tokens
            ev["cached_tokens"] = 0
        s.produced += n
        done = s.produced >= s.max_tokens
        if done:
            ev["finish_reason"] = "length"
        line = json.dumps(ev, separators=(",", ":")).encode() + b"\n"
        chunk = b"%x\r\n%s\r\n" % (len(line), line)
        return chunk + b"0\r\n\r\n" if done else chunk

    async def stepper(self) -> None:
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        while True:
            next_step += self.step_s  # a fixed cadence, whatever a step's writes cost
            await asyncio.sleep(max(0.0, next_step - loop.time()))
            for s in list(self.streams):
                if s.transport.is_closing():
                    self.streams.discard(s)
                    continue
                s.transport.write(self.event(s))
                if s.produced >= s.max_tokens:
                    self.streams.discard(s)
                    self.served += 1

    def generate(self, transport: asyncio.Transport, body: bytes) -> None:
        req = json.loads(body)
        s = _Stream(transport, int(req["sampling"].get("max_tokens", 16)), len(req["token_ids"]))
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n")
        if self.step_s > 0:
            self.streams.add(s)
            return
        parts = []
        while s.produced < s.max_tokens:
            parts.append(self.event(s))
        transport.write(b"".join(parts))
        self.served += 1


class _Connection(asyncio.Protocol):
    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            length = 0
            for h in head[1:]:
                name, _, value = h.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            method, path, _ = head[0].split(" ", 2)
            self.handle(method, path, body)

    def handle(self, method: str, path: str, body: bytes) -> None:
        assert self.transport is not None
        if method == "POST" and path == "/internal/generate":
            self.worker.generate(self.transport, body)
            return
        if method == "GET" and path == "/load":
            payload = self.worker.load_body()
        elif method == "GET" and path in ("/health", "/ready"):
            payload = b'{"status":"ok"}'
        else:
            self.transport.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(payload)
        self.transport.write(head + payload)


async def serve(worker: FakeWorker, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(worker), host, port, backlog=4096)
    stepper = asyncio.create_task(worker.stepper()) if worker.step_s > 0 else None
    try:
        await server.serve_forever()
    finally:
        if stepper is not None:
            stepper.cancel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/fake_worker.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["prefill", "decode"], default="decode")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--pod", default="")
    p.add_argument("--step-s", type=float, default=0.0, help="seconds between a stream's events (0: all at once)")
    p.add_argument("--tokens-per-event", type=int, default=1)
    args = p.parse_args(argv)
    worker = FakeWorker(args.role, args.pod or f"fake-{args.role}-{args.port}", args.step_s, args.tokens_per_event)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(serve(worker, args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
