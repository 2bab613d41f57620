"""Streaming load for bench/router.py: many concurrent SSE clients in several processes, counting the
tokens they receive, and the CPU the router's processes spend on them.

Each client process runs ``streams`` closed-loop streams (uvloop when installed), each on its own
keep-alive connection: POST a streamed completion, read the SSE body to its end, repeat. It counts the
``data: {`` events (one per token: the fake workers emit one token per event, and each token of their
script is whole text), the time to the first event, and the gaps between reads that carried events
(the inter-token latency a client sees) inside the measuring window. A bare asyncio client, so that the
load generator costs less CPU than what it measures.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LoadResult", "process_tree_cpu_s", "run_load"]

_EVENT = b"data: {"
_DONE = b"data: [DONE]"


@dataclass
class LoadResult:
    tokens: int = 0
    requests: int = 0
    errors: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    first_error: str = ""


async def _one_stream(host: str, port: int, request: bytes, t_measure: float, t_end: float, out: LoadResult) -> None:
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            if status != 200:
                out.statuses[str(status)] = out.statuses.get(str(status), 0) + 1
                out.errors += 1
                length = next(
                    (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
                )
                body = await reader.readexactly(length)
                out.first_error = out.first_error or body.decode(errors="replace")[:300]
                await asyncio.sleep(0.05)
                continue
            first = last = None
            tail = b""
            done = False
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    raise ConnectionError("router closed the stream")
                now = time.perf_counter()
                scan = tail + data
                n = scan.count(_EVENT)
                if n:
                    if first is None:
                        first = now
                        if now >= t_measure:
                            out.ttft_s.append(now - t0)
                    elif t_measure <= now < t_end:
                        out.itl_s.append(now - last)  # type: ignore[operator]
                    last = now
                    if t_measure <= now < t_end:
                        out.tokens += n
                done = done or _DONE in scan
                if done and scan.endswith(b"0\r\n\r\n"):
                    break
                tail = scan[-16:]
            if t_measure <= time.perf_counter() < t_end:
                out.requests += 1
    finally:
        writer.close()


async def _client(
    host: str, port: int, streams: int, body: bytes, warmup_s: float, seconds: float, start_at: float
) -> LoadResult:
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    # Every process starts its streams at the same wall-clock instant, spread over the first 0.5 s.
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t_measure = time.perf_counter() + warmup_s
    t_end = t_measure + seconds
    out = LoadResult()

    async def staggered(i: int) -> None:
        await asyncio.sleep(0.5 * i / max(1, streams))
        await _one_stream(host, port, request, t_measure, t_end, out)

    results = await asyncio.gather(*(staggered(i) for i in range(streams)), return_exceptions=True)
    out.errors += sum(1 for r in results if isinstance(r, BaseException))
    return out


def _client_process(args: tuple[Any, ...], queue: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    res = run(_client(*args))
    queue.put(res.__dict__)


def run_load(
    url: str,
    processes: int,
    streams_per_process: int,
    max_tokens: int,
    prompt: str | list[int],
    warmup_s: float,
    seconds: float,
) -> LoadResult:
    """Runs the load and merges the processes' counts (the window is the same wall-clock span for all)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True}
    ).encode()
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    start_at = time.time() + 1.0 + 0.2 * processes  # after every process has started
    procs = [
        ctx.Process(
            target=_client_process,
            args=((host, int(port), streams_per_process, body, warmup_s, seconds, start_at), queue),
        )
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    merged = LoadResult()
    for _ in procs:
        r = queue.get(timeout=warmup_s + seconds + 120)
        merged.tokens += r["tokens"]
        merged.requests += r["requests"]
        merged.errors += r["errors"]
        for k, v in r["statuses"].items():
            merged.statuses[k] = merged.statuses.get(k, 0) + v
        merged.ttft_s += r["ttft_s"]
        merged.itl_s += r["itl_s"]
        merged.first_error = merged.first_error or r["first_error"]
    for p in procs:
        p.join(10)
    return merged


def process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(f[11]) + int(f[12])) / tick
        todo += children.get(p, [])
    return total
