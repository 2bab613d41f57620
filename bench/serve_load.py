"""Load for the serving benchmark: token-id workloads, Poisson and closed-loop arrivals, and a streaming
client that timestamps every token it receives.

Honest inter-token latency needs to know when each token reached the client and how tokens were grouped
on the way. Each read from the socket is timestamped as it returns; the SSE events in it are parsed and
each event's tokens counted (one word per token with bench/synthetic_tokenizer.py). Tokens that share an
event (the server put them together) or a read (several events already waited in the socket) get the
same arrival time, so a burst shows up as one long gap and several ~0 gaps, not as a smooth stream. The
client's own lateness is measured beside it: an event-loop lag probe, the CPU time the client used, and
how late each request was sent against its schedule.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

SLO_CLASS_HEADER = "x-kvferry-class"  # the router's (router/surface/service.py)

__all__ = [
    "Arrivals",
    "LoadClient",
    "PointRun",
    "RequestRecord",
    "TokenRange",
    "WorkItem",
    "make_workload",
    "run_point",
]

try:  # faster JSON for the per-event parse when available
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads


@dataclass(frozen=True)
class TokenRange:
    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> TokenRange:
        lo, _, hi = text.partition("-")
        r = cls(int(lo), int(hi or lo))
        if r.lo < 1 or r.hi < r.lo:
            raise ValueError(f"bad range {text!r} (LO-HI, 1 <= LO <= HI)")
        return r

    def __str__(self) -> str:
        return f"{self.lo}-{self.hi}"


@dataclass(frozen=True)
class WorkItem:
    prompt_len: int
    max_tokens: int
    payload: bytes  # the request body, serialized before the clock starts
    slo_class: str = ""  # sent as the x-kvferry-class header ("": none, the deployment's default class)


def make_workload(
    num: int,
    prompt_len: TokenRange,
    output_len: TokenRange,
    vocab: int,
    seed: int,
    model: str,
    class_mix: Sequence[tuple[str, float]] = (),
) -> list[WorkItem]:
    """``num`` requests: random token-id prompts and output lengths, uniform in their ranges, exact
    (``ignore_eos``). Different seeds give prompts that share no prefix (no cache hits across points).
    `class_mix` (SLO class, weight): each request's class drawn at those weights, from its own random stream
    (the prompts stay those of a run without classes)."""
    rng = random.Random(seed)
    pick = random.Random(seed + 7_777_777)
    names, weights = [n for n, _ in class_mix], [w for _, w in class_mix]
    items = []
    for _ in range(num):
        n_in = rng.randint(prompt_len.lo, prompt_len.hi)
        n_out = rng.randint(output_len.lo, output_len.hi)
        body = {
            "model": model,
            "prompt": [rng.randrange(vocab) for _ in range(n_in)],
            "max_tokens": n_out,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        cls = pick.choices(names, weights)[0] if names else ""
        items.append(WorkItem(n_in, n_out, json.dumps(body, separators=(",", ":")).encode(), cls))
    return items


@dataclass(frozen=True)
class Arrivals:
    kind: str  # rate (Poisson, requests/s; inf = all at once) | concurrency (closed loop)
    value: float

    @property
    def label(self) -> str:
        v = "inf" if self.value == float("inf") else f"{self.value:g}"
        return f"{self.kind} {v}"


@dataclass
class RequestRecord:
    index: int
    prompt_len: int
    max_tokens: int
    scheduled_s: float = 0.0  # intended send time, from the point's start
    sent_s: float = 0.0  # actual send time, from the point's start
    outcome: str = "pending"  # ok | short | http_429 | http_5xx | http_4xx | conn_error | stream_error | timeout
    http_status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each token, from the send
    tokens: int = 0
    usage_tokens: int | None = None
    events: int = 0  # SSE events that carried tokens
    reads: int = 0  # socket reads that carried tokens
    tokens_in_multi_event_reads: int = 0  # arrived in a read holding several token events
    tokens_in_multi_token_events: int = 0  # arrived in an event holding several tokens
    error: str = ""
    retry_after_s: float | None = None  # a 429's Retry-After
    retries: int = 0  # 429s answered by waiting Retry-After and sending again (--retry-429)
    refusals_s: list[float] = field(default_factory=list)  # each 429's time from its send to the answer
    slo_class: str = ""  # the SLO class it was sent as ("": none named)
    attempt_at: float = 0.0  # perf_counter when its last attempt was sent: its token_times count from here


class _SSEReader:
    """Splits a response's bytes into SSE events and books each event's tokens on the record."""

    def __init__(self, record: RequestRecord, count_tokens: Callable[[str], int]) -> None:
        self.record = record
        self.count_tokens = count_tokens
        self.buf = b""
        self.done = False

    def feed(self, data: bytes, now_rel: float) -> None:
        rec = self.record
        self.buf += data
        *events, self.buf = self.buf.split(b"\n\n")
        read_tokens = 0
        token_events = 0
        for raw in events:
            if not raw.startswith(b"data: "):
                continue
            body = raw[6:]
            if body == b"[DONE]":
                self.done = True
                continue
            msg = _loads(body)
            if "error" in msg:
                rec.error = str(msg["error"])[:300]
                continue
            if msg.get("usage"):
                rec.usage_tokens = int(msg["usage"]["completion_tokens"])
            for choice in msg.get("choices") or ():
                k = self.count_tokens(choice.get("text") or "")
                if k:
                    token_events += 1
                    read_tokens += k
                    rec.events += 1
                    if k > 1:
                        rec.tokens_in_multi_token_events += k
                    rec.token_times.extend([now_rel] * k)
        if read_tokens:
            rec.reads += 1
            if token_events > 1:
                rec.tokens_in_multi_event_reads += read_tokens
            if rec.ttft_s is None:
                rec.ttft_s = now_rel
            rec.tokens += read_tokens


class LoadClient:
    """Streams /v1/completions with aiohttp when installed (less CPU per event), else httpx."""

    def __init__(self, base_url: str, request_timeout_s: float) -> None:
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.timeout_s = request_timeout_s
        self.count_tokens: Callable[[str], int] = _count_events
        self.parse_s = 0.0  # time spent parsing what was read: the client's own cost per token
        self._session: Any = None
        try:
            import aiohttp  # noqa: F401

            self.backend = "aiohttp"
        except ImportError:  # pragma: no cover - depends on the environment
            self.backend = "httpx"

    async def __aenter__(self) -> LoadClient:
        if self.backend == "aiohttp":
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.timeout_s),
            )
        else:
            import httpx

            self._session = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                timeout=httpx.Timeout(self.timeout_s, connect=10.0),
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.backend == "aiohttp":
            await self._session.close()
        else:
            await self._session.aclose()

    async def send(self, item: WorkItem, rec: RequestRecord) -> None:
        reader = _SSEReader(rec, self.count_tokens)
        headers = {"content-type": "application/json"}
        if item.slo_class:
            headers[SLO_CLASS_HEADER] = item.slo_class
        clock = time.perf_counter
        start = rec.attempt_at = clock()
        try:
            if self.backend == "aiohttp":
                async with self._session.post(self.url, data=item.payload, headers=headers) as resp:
                    rec.http_status = resp.status
                    if resp.status == 200:
                        async for chunk in resp.content.iter_any():
                            now = clock()
                            reader.feed(chunk, now - start)
                            self.parse_s += clock() - now
                    else:
                        rec.error = (await resp.read())[:300].decode(errors="replace")
                        rec.retry_after_s = _seconds(resp.headers.get("retry-after"))
            else:
                async with self._session.stream("POST", self.url, content=item.payload, headers=headers) as resp:
                    rec.http_status = resp.status_code
                    if resp.status_code == 200:
                        async for chunk in resp.aiter_raw():
                            now = clock()
                            reader.feed(chunk, now - start)
                            self.parse_s += clock() - now
                    else:
                        rec.error = (await resp.aread())[:300].decode(errors="replace")
                        rec.retry_after_s = _seconds(resp.headers.get("retry-after"))
        except asyncio.CancelledError:
            rec.outcome = "timeout"
            raise
        except Exception as exc:  # connection refused/reset, read timeout: the server's fault, counted
            rec.outcome = "conn_error"
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
            return
        rec.e2e_s = clock() - start
        rec.outcome = _outcome(rec, reader.done)
        if rec.http_status == 429:
            rec.refusals_s.append(rec.e2e_s)


def _seconds(header: str | None) -> float | None:
    try:
        return max(0.0, float(header)) if header is not None else None
    except ValueError:
        return None


def _outcome(rec: RequestRecord, done: bool) -> str:
    if rec.http_status == 429:
        return "http_429"
    if rec.http_status >= 500:
        return "http_5xx"
    if rec.http_status != 200:
        return "http_4xx"
    if rec.error or not done:
        return "stream_error"
    # The server's own count when it gave one: the client's count is only exact with the synthetic tokenizer.
    produced = rec.usage_tokens if rec.usage_tokens is not None else rec.tokens
    return "ok" if produced == rec.max_tokens else "short"


def _count_events(text: str) -> int:
    """Fallback token count when the router's tokenizer is not the synthetic one: one per text event."""
    return 1 if text else 0


@dataclass
class PointRun:
    records: list[RequestRecord]
    wall_s: float  # first send to last finish
    loop_lag_s: list[float]  # event-loop lag samples during the point
    client_cpu_s: float  # CPU time of this process during the point
    client_parse_s: float  # of which parsing responses
    timed_out: int
    loop_lag_end_at: list[float] = field(default_factory=list)  # perf_counter when each lag sample ended


LAG_PROBE_PERIOD_S = 0.005


async def _lag_probe(stop: asyncio.Event, out: list[float], ends: list[float]) -> None:
    clock = time.perf_counter
    while not stop.is_set():
        t = clock()
        await asyncio.sleep(LAG_PROBE_PERIOD_S)
        now = clock()
        out.append(max(0.0, now - t - LAG_PROBE_PERIOD_S))
        ends.append(now)


async def run_point(
    client: LoadClient,
    items: list[WorkItem],
    arrivals: Arrivals,
    seed: int,
    drain_timeout_s: float,
    retry_429: bool = False,
) -> PointRun:
    """Sends every item once (Poisson at ``arrivals.value`` req/s, or ``value`` in flight at a time) and
    waits for all of them, at most ``drain_timeout_s`` after the last send (the rest count as timeouts).
    With ``retry_429`` a request refused 429 waits its Retry-After and is sent again, as a well-behaved
    client would (what a saturation measurement needs: the server's admission paces the load instead of
    dropping it); its TTFT then counts from the accepted attempt, and ``retries`` says how many it took."""
    # The points before this one (their records and token times, a run's whole history) stay out of the collector's
    # walks: a full collection of them stalls every stream the client reads at once, which reads as the server's
    # shared gap (the lag probe saw one 62 ms client stall at H100 FP8 30 req/s, the run's seventh point).
    gc.collect()
    gc.freeze()
    records = [RequestRecord(i, it.prompt_len, it.max_tokens, slo_class=it.slo_class) for i, it in enumerate(items)]
    lags: list[float] = []
    lag_ends: list[float] = []
    stop = asyncio.Event()
    clock = time.perf_counter
    start = clock()
    probe = asyncio.create_task(_lag_probe(stop, lags, lag_ends))
    cpu0 = time.process_time()
    parse0 = client.parse_s

    async def one(i: int) -> None:
        rec = records[i]
        rec.sent_s = clock() - start
        await client.send(items[i], rec)
        while retry_429 and rec.outcome == "http_429":
            await asyncio.sleep(rec.retry_after_s if rec.retry_after_s is not None else 1.0)
            rec.retries += 1
            rec.http_status, rec.error, rec.retry_after_s = 0, "", None
            await client.send(items[i], rec)

    tasks: list[asyncio.Task[None]] = []
    if arrivals.kind == "rate":
        rng = random.Random(seed)
        t_next = 0.0
        for i in range(len(items)):
            records[i].scheduled_s = t_next
            delay = start + t_next - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
            if arrivals.value != float("inf"):
                t_next += rng.expovariate(arrivals.value)
    elif arrivals.kind == "concurrency":
        queue = iter(range(len(items)))

        async def worker() -> None:
            for i in queue:
                records[i].scheduled_s = clock() - start
                await one(i)

        tasks = [asyncio.create_task(worker()) for _ in range(max(1, int(arrivals.value)))]
    else:
        raise ValueError(f"unknown arrivals {arrivals.kind!r}")

    # Closed loop: the drain window starts now too; sends go on inside it, so give it the whole budget.
    _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    stop.set()
    await probe
    finished = [r.sent_s + r.e2e_s for r in records if r.e2e_s is not None]
    wall = (max(finished) if finished else clock() - start) - min((r.sent_s for r in records), default=0.0)
    timed_out = 0
    for r in records:
        if r.outcome == "pending":  # a closed-loop request never sent before the deadline
            r.outcome = "timeout"
        timed_out += r.outcome == "timeout"
    return PointRun(records, wall, lags, time.process_time() - cpu0, client.parse_s - parse0, timed_out, lag_ends)
