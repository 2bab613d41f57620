"""A bounded soak through the router on CPU: many short requests at high concurrency against a real local
cluster (redis-server, 1 prefill + 1 decode worker, the router), with nothing lost and nothing left behind.

Every request must end, within its deadline, with a 200 whose body is complete (a finish reason, usage; a
stream ends with [DONE] and carries no error) or with a 429 carrying Retry-After (the router's admission
limit is set below the concurrency on purpose, so that path is exercised; a client that gets one waits
as told). Queues stay bounded while it runs, every KV page is back at the end, and the workers' memory
(control plane + engine process, sampled from /proc) does not grow beyond a generous bound.

Size: KVFERRY_SOAK_REQUESTS (CI default below) at KVFERRY_SOAK_CONCURRENCY. By hand, e.g.
``KVFERRY_SOAK_REQUESTS=2000 KVFERRY_SOAK_CONCURRENCY=64 python -m pytest tests/test_soak.py -s``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.devcluster.cluster import LocalCluster
from common.worker.engine_loop import IDLE_TRIM_S
from tests.helpers import load, pages_back, running_cluster, wait_pages_back, wait_until

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m-instruct"
REQUESTS = int(os.environ.get("KVFERRY_SOAK_REQUESTS", "500"))
CONCURRENCY = int(os.environ.get("KVFERRY_SOAK_CONCURRENCY", "48"))
MAX_INFLIGHT = max(1, CONCURRENCY - 8)  # router admission limit: beyond it, 429 + Retry-After
REQUEST_TIMEOUT_S = 120.0
# Measured decode growth: +55 MB at the CI size (500 requests), +127 MB at 1,500 (bench/RESULTS.md).
RSS_GROWTH_LIMIT_MB = 250.0
ENV = {
    "KVFERRY_NUM_PAGES": "512",
    "KVFERRY_MAX_RUNNING": "64",
    "KVFERRY_MAX_PREFILL_TOKENS": "512",
    "KVFERRY_ROUTER_MAX_INFLIGHT": str(MAX_INFLIGHT),
    "KVFERRY_ROUTER_RETRY_AFTER_S": "1",
}


# ---- process memory ------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its descendants (a worker: control plane + engine process)."""
    own = 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                own = int(line.split()[1]) / 1024
    except OSError:
        pass
    return own + sum(rss_mb(c) for c in _children(pid))


def memory(cluster: LocalCluster) -> dict[str, float]:
    parts = [*cluster.workers, cluster.router]
    return {p.name: round(rss_mb(p.proc.pid), 1) for p in parts if p is not None and p.proc is not None}


def wait_trimmed(urls: list[str]) -> None:
    """Every worker is idle and its engine handed the allocator's free memory back (engine_loop.py): what its
    RSS is then is what it holds, not what glibc keeps for reuse."""
    for u in urls:
        wait_until(lambda u=u: (ld := load(u))["idle_trimmed"] and pages_back(ld), IDLE_TRIM_S + 10, f"{u} trimmed")


# ---- the cluster ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(prefill=1, decode=1, env=ENV, wait_up=False) as c:
        yield c


# ---- the load ------------------------------------------------------------------------------------
SYSTEMS = [
    (f"You are a helpful assistant for the {topic} department. Answer in one short sentence. " * 20).strip()
    for topic in ("billing", "shipping", "returns", "support")
]
QUESTIONS = ["What is your name?", "Say hello.", "Name a fruit.", "Count to three.", "What day is it?", "Why?"]


def make_request(i: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A varied mix: chat and completions, streamed and not, short prompts (decode-local prefill) and long
    shared system prompts (disaggregated, prefix-cache hits), n=2 now and then."""
    max_tokens = rng.choice((2, 3, 4))
    stream = rng.random() < 0.4
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": stream,
        "temperature": rng.choice((0, 0.7)),
    }
    if rng.random() < 0.1:
        body["n"] = 2
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    q = f"{rng.choice(QUESTIONS)} (#{i})"
    if rng.random() < 0.5:
        msgs = [{"role": "user", "content": q}]
        if rng.random() < 0.3:  # long, shared: goes to the prefill worker, mostly from its cache
            msgs.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
        return "/v1/chat/completions", {**body, "messages": msgs}
    prompt = q if rng.random() < 0.7 else rng.choice(SYSTEMS) + " " + q
    return "/v1/completions", {**body, "prompt": prompt, "ignore_eos": rng.random() < 0.5}


@dataclass
class Stats:
    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    peak_router_inflight: int = 0
    peak_waiting: int = 0
    peak_running: int = 0
    sent: int = 0


def check_ok(path: str, body: dict[str, Any], resp_text: str, streamed: bool) -> str | None:
    n = body.get("n", 1)
    if not streamed:
        data = json.loads(resp_text)
        choices = data.get("choices") or []
        if len(choices) != n:
            return f"{len(choices)} choices, expected {n}"
        for c in choices:
            if c.get("finish_reason") not in ("length", "stop"):
                return f"finish_reason {c.get('finish_reason')!r}"
        if data["usage"]["completion_tokens"] < 1 or data["usage"]["completion_tokens"] > n * body["max_tokens"]:
            return f"usage {data['usage']}"
        return None
    events = [line[6:] for line in resp_text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "stream did not end with [DONE]"
    finished = set()
    for raw in events[:-1]:
        ev = json.loads(raw)
        if "error" in ev:
            return f"error event in stream: {ev['error']}"
        for c in ev.get("choices", []):
            if c.get("finish_reason"):
                if c["finish_reason"] not in ("length", "stop"):
                    return f"finish_reason {c['finish_reason']!r}"
                finished.add(c["index"])
    if len(finished) != n:
        return f"{len(finished)} choices finished, expected {n}"
    return None


async def _one(client: httpx.AsyncClient, i: int, rng: random.Random, stats: Stats) -> None:
    path, body = make_request(i, rng)
    while True:  # a 429 is an answer; its client waits as told and asks again (a fresh request)
        stats.sent += 1
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                r = await client.post(path, json=body)
        except TimeoutError:
            stats.outcomes["hung"] += 1
            stats.problems.append(f"#{i} hung past {REQUEST_TIMEOUT_S:g}s: {path} {body}")
            return
        except httpx.HTTPError as e:
            stats.outcomes["lost"] += 1
            stats.problems.append(f"#{i} transport error {e!r}: {path} {body}")
            return
        if r.status_code == 429:
            stats.outcomes["429"] += 1
            retry_after = r.headers.get("retry-after")
            if retry_after is None or not retry_after.isdigit() or r.json()["error"]["type"] != "rate_limit_error":
                stats.problems.append(f"#{i} 429 without Retry-After/OpenAI body: {r.headers} {r.text[:200]}")
                return
            await asyncio.sleep(int(retry_after))
            continue
        if r.status_code != 200:
            stats.outcomes[str(r.status_code)] += 1
            stats.problems.append(f"#{i} HTTP {r.status_code}: {r.text[:300]} for {path} {body}")
            return
        stats.latencies.append(time.monotonic() - t0)
        problem = check_ok(path, body, r.text, bool(body.get("stream")))
        stats.outcomes["200" if problem is None else "bad 200"] += 1
        if problem:
            stats.problems.append(f"#{i} {problem}: {path} {body}")
        return


async def _monitor(cluster: LocalCluster, stats: Stats, done: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=5) as c:
        while not done.is_set():
            try:
                w = (await c.get(f"{cluster.router_url}/router/workers")).json()
                stats.peak_router_inflight = max(stats.peak_router_inflight, w["inflight"])
                for url in cluster.decode_urls + cluster.prefill_urls:
                    ld = (await c.get(f"{url}/load")).json()
                    stats.peak_waiting = max(stats.peak_waiting, ld["waiting_requests"])
                    stats.peak_running = max(stats.peak_running, ld["running_requests"])
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(done.wait(), 0.25)
            except TimeoutError:
                pass


async def soak(cluster: LocalCluster, n: int, concurrency: int, seed: int = 7) -> Stats:
    stats = Stats()
    rng = random.Random(seed)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=cluster.router_url, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:

        async def user() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await _one(client, i, rng, stats)

        done = asyncio.Event()
        monitor = asyncio.create_task(_monitor(cluster, stats, done))
        await asyncio.gather(*(user() for _ in range(concurrency)))
        done.set()
        await monitor
    return stats


def test_soak_nothing_lost_nothing_leaked(cluster: LocalCluster) -> None:
    urls = cluster.prefill_urls + cluster.decode_urls
    # Warm up at full concurrency (batch-sized buffers, allocator arenas, lazily built state), then take
    # the memory baseline: growth over the soak itself is what a leak would show.
    warm = asyncio.run(soak(cluster, 2 * CONCURRENCY, CONCURRENCY, seed=1))
    assert not warm.problems, warm.problems[:5]
    wait_pages_back(*urls, timeout=30)
    wait_trimmed(urls)
    before = memory(cluster)

    t0 = time.monotonic()
    stats = asyncio.run(soak(cluster, REQUESTS, CONCURRENCY))
    wall = time.monotonic() - t0

    # Everything is back: no request left on a worker, every page free, nothing admitted in the router.
    pages_back_s = wait_pages_back(*urls, timeout=30)
    router = httpx.get(f"{cluster.router_url}/router/workers", timeout=5).json()
    wait_trimmed(urls)
    after = memory(cluster)
    lat = sorted(stats.latencies)
    p50 = lat[len(lat) // 2] if lat else 0.0
    p99 = lat[int(len(lat) * 0.99)] if lat else 0.0
    growth = {k: round(after[k] - before[k], 1) for k in before}
    print(
        f"\nsoak: {REQUESTS} requests at concurrency {CONCURRENCY} in {wall:.1f}s "
        f"({REQUESTS / wall:.1f} req/s); sent {stats.sent} (with 429 retries); outcomes {dict(stats.outcomes)}; "
        f"200 latency p50 {p50:.2f}s p99 {p99:.2f}s; peak router inflight {stats.peak_router_inflight}/{MAX_INFLIGHT}, "
        f"peak worker running {stats.peak_running} waiting {stats.peak_waiting}; pages back after {pages_back_s:.2f}s; "
        f"RSS MB before {before} after {after} growth {growth}; peak RSS {max(after.values()):.0f} MB; "
        f"routing {router['decisions']}"
    )
    assert not stats.problems, "\n".join(stats.problems[:20])
    assert stats.outcomes["200"] == REQUESTS, stats.outcomes
    assert stats.outcomes["lost"] == 0 and stats.outcomes["hung"] == 0
    assert router["inflight"] == 0, router
    # Both paths ran: prompts prefilled on the decode pod and prompts prefilled on the prefill pod (KV
    # moved over NIXL).
    decisions = router["decisions"]
    assert decisions.get("disaggregated", 0) > 0 and decisions.get("short-prompt", 0) > 0, decisions
    # Bounded queues: the router never admitted more than its limit; the workers never queued more than
    # the router could have sent them (each admitted request is at most n=2 upstream calls).
    assert stats.peak_router_inflight <= MAX_INFLIGHT
    assert stats.peak_running + stats.peak_waiting <= 2 * MAX_INFLIGHT
    for name, g in growth.items():
        assert g < RSS_GROWTH_LIMIT_MB, f"{name} grew {g} MB over the soak ({before[name]} -> {after[name]} MB)"
