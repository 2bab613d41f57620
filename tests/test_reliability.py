"""Faults on CPU against a real local cluster (redis-server, 2 prefill + 2 decode workers, the router):
kill -9 of a prefill worker mid-transfer, of a decode worker mid-stream and of the router mid-stream; a
prefill worker restarted on the same address; Redis killed and restarted; clients that hang up mid-stream
or mid-prefill; a worker that stops answering (SIGSTOP).

Every test asserts the same four things: the request in flight succeeds (retried before its first token, or
its stream continued on another decode worker with the text an uninterrupted run gives: router/upstream/migration.py)
or, where nothing can save it, gets a clear OpenAI-shaped error; nothing waits past a deadline (every wait here is bounded); every KV page comes
back on every worker (``/load``: free_pages == total_pages, running_requests == 0); and the system keeps
serving (a follow-up request succeeds). Each test leaves the cluster whole again (killed parts are
restarted on their addresses), so the tests can run in any order.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import redis

from common.devcluster.cluster import LocalCluster
from common.devcluster.process import ManagedProcess, kvferry_argv, wait_ready
from common.net import free_port
from tests.helpers import assert_openai_error, engine_pid, load, running_cluster, wait_pages_back, wait_until

pytestmark = pytest.mark.timeout(240)

MODEL = "smollm2-135m-instruct"
# Small KV pools and a small prefill chunk, so a long prompt takes many chunks (a window to kill the
# prefill worker mid-transfer). Long prompts always go to a prefill pod (never "the decode pod holds the
# prefix"), so the prefill and transfer paths are exercised on purpose.
ENV = {
    "KVFERRY_NUM_PAGES": "256",
    "KVFERRY_MAX_PREFILL_TOKENS": "64",
    "KVFERRY_PAGE_SIZE": "16",
    "KVFERRY_ROUTER_LOCAL_PREFIX_FRACTION": "2",
    "KVFERRY_ROUTER_DISAGG_MIN_PROMPT_TOKENS": "256",
}
FAULTS_SURVIVED: list[str] = []


# ---- helpers of the cluster tests (shared ones: tests/helpers.py) --------------------------------
def worker_urls(cluster: LocalCluster) -> list[str]:
    return [w.url for w in cluster.workers if w.url]


def part_for(cluster: LocalCluster, url: str) -> ManagedProcess:
    return next(p for p in cluster.parts if p.url == url)


def abort_times(urls: list[str], timeout: float) -> dict[str, float]:
    """Seconds until each worker reports nothing running (its snapshot is at most ~0.1 s old)."""
    t0 = time.monotonic()
    took: dict[str, float] = {}
    while len(took) < len(urls):
        for u in urls:
            if u not in took and load(u)["running_requests"] == 0:
                took[u] = round(time.monotonic() - t0, 3)
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"requests still running after {timeout:g}s: {took}")
        time.sleep(0.02)
    return took


def router_workers(cluster: LocalCluster) -> dict[str, Any]:
    return httpx.get(f"{cluster.router_url}/router/workers", timeout=5).json()


def router_says_up(cluster: LocalCluster, url: str) -> bool:
    return any(w["url"] == url and w["up"] for w in router_workers(cluster)["workers"])


def wait_all_up(cluster: LocalCluster, timeout: float = 60.0) -> None:
    wait_until(lambda: all(w["up"] for w in router_workers(cluster)["workers"]), timeout, "router sees every worker up")


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + (labels or "")) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head == name + labels or (not labels and head.split("{")[0] == name):
                total += float(value)
    return total


def long_prompt(words: int = 300) -> str:
    """A prompt of roughly `words` + a few tokens that shares no prefix with any other (the nonce leads)."""
    nonce = uuid.uuid4().hex[:12]
    filler = " ".join(
        ("river", "mountain", "valley", "forest", "meadow", "harbor", "canyon", "glacier")[i % 8] for i in range(words)
    )
    return f"[{nonce}] Summarize this travel log: {filler}"


def sse_events(resp: httpx.Response) -> Iterator[dict[str, Any] | str]:
    """Parsed `data:` payloads of an SSE response; "[DONE]" as the string."""
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def restart(part: ManagedProcess, timeout: float = 120.0) -> None:
    """Starts a killed part again on its address and waits for it to be ready."""
    if part.alive():
        part.kill_group()
    part.start()
    wait_until(
        lambda: part.alive() and httpx.get(f"{part.url}/ready", timeout=2).status_code == 200,
        timeout,
        f"{part.name} ready after restart",
        interval=0.2,
    )


def completion(
    cluster: LocalCluster, prompt: str, max_tokens: int = 4, timeout: float = 60.0, **extra: Any
) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=timeout)


def assert_serving(cluster: LocalCluster) -> None:
    """The system keeps serving: a short and a long (disaggregated) request both succeed."""
    for prompt in ("The capital of France is", long_prompt()):
        r = completion(cluster, prompt, max_tokens=3)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1


# ---- the shared cluster --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    try:
        with running_cluster(prefill=2, decode=2, env=ENV) as c:
            yield c
    finally:
        print(f"\nfaults survived: {len(FAULTS_SURVIVED)} ({', '.join(FAULTS_SURVIVED)})")


@pytest.fixture
def healthy(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """Each test starts and ends with every part alive, up in the router, and every page free."""
    for p in cluster.parts:
        if not p.alive():
            if p is cluster.redis:
                cluster.start_redis()
            else:
                restart(p)
    wait_all_up(cluster)
    wait_pages_back(*worker_urls(cluster))
    yield cluster
    wait_pages_back(*worker_urls(cluster))


def _busy(urls: list[str], min_running: int = 1) -> str | None:
    for u in urls:
        if load(u)["running_requests"] >= min_running:
            return u
    return None


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["result"] = fn()
        except BaseException as e:  # reported to the test thread
            out["exc"] = e
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _reach(c: LocalCluster, url: str, done: float, pairs: int = 6) -> None:
    """Long prompts, two at a time, until the prefill worker at `url` has finished `done` requests. Two at once:
    one request alone goes where the TTFT prediction is best, and a restarted worker's model may hold its cold
    first prefill; the second of a pair sees the first queued on the other pod."""
    for _ in range(pairs):
        pair = [_in_thread(lambda: completion(c, long_prompt(), max_tokens=2, timeout=120)) for _ in range(2)]
        for t, out in pair:
            t.join(120)
            assert "exc" not in out, out
            assert out["result"].status_code == 200, out["result"].text
        if metric(url, "kvferry_requests_total", '{outcome="done"}') >= done:
            return
    assert metric(url, "kvferry_requests_total", '{outcome="done"}') >= done, "no request went through it"


# ---- kill -9 ---------------------------------------------------------------------------------------
def test_kill9_prefill_worker_mid_transfer_then_restart_on_same_address(healthy: LocalCluster) -> None:
    c = healthy
    prompt = long_prompt(800)
    t, out = _in_thread(lambda: completion(c, prompt, max_tokens=4, timeout=120))
    # The prefill pod that got it is computing chunks and pushing each one into the decode pod's pages.
    victim_url = wait_until(
        lambda: next(
            (
                u
                for u in c.prefill_urls
                if 0 < (ld := load(u))["queued_prefill_tokens"] < 750 and ld["running_requests"]
            ),
            None,
        ),
        60,
        "a prefill worker mid-prefill with chunks sent",
        interval=0.02,
    )
    victim = part_for(c, victim_url)
    victim.kill_group()
    t.join(90)
    assert not t.is_alive(), "the request hung after its prefill worker died"
    assert "exc" not in out, out
    r: httpx.Response = out["result"]
    # The decode worker gives up on the lost prefill and the router retries it on the other prefill pod (or
    # locally): the client never sees the loss.
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert out["seconds"] < 60, out
    survivors = [u for u in worker_urls(c) if u != victim_url]
    wait_pages_back(*survivors)
    assert_serving(c)
    wait_until(lambda: not router_says_up(c, victim_url), 10, "router marks the dead prefill worker down")
    FAULTS_SURVIVED.append("kill -9 prefill mid-transfer")

    # Restarted on the same address: a new process and NIXL instance behind a URL the decode workers know
    # (one of them handshook with the old instance). The router brings it back, and requests through it
    # work: the decode side handshakes with the new instance.
    restart(victim)
    wait_until(lambda: router_says_up(c, victim_url), 30, "restarted prefill worker up in the router")
    assert metric(victim_url, "kvferry_requests_total", '{outcome="done"}') == 0
    _reach(c, victim_url, done=2)
    assert metric(victim_url, "kvferry_requests_total", '{outcome="error"}') == 0
    FAULTS_SURVIVED.append("prefill restarted on the same address")


def _migration_requests() -> list[tuple[str, dict[str, Any]]]:
    """Streams of every kind a migration must carry over the seam unchanged."""
    story = "Tell me a very long story about a lighthouse keeper."
    return [
        ("completions", {"prompt": story, "max_tokens": 60, "temperature": 0, "ignore_eos": True}),
        # n=2, seeded sampling: each choice draws by its seed and output position on whichever worker.
        ("completions", {"prompt": story, "max_tokens": 60, "temperature": 1.0, "seed": 7, "n": 2, "ignore_eos": True}),
        (
            "chat/completions",
            {
                "messages": [{"role": "user", "content": "Describe the sea in many words."}],
                "max_tokens": 60,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
                "ignore_eos": True,
            },
        ),
        (
            "completions",
            {"prompt": long_prompt(), "max_tokens": 60, "temperature": 0.7, "seed": 3, "frequency_penalty": 1.0},
        ),
    ]


def _run_stream(c: LocalCluster, path: str, body: dict[str, Any], started: threading.Event) -> dict[str, Any]:
    """Streams one request; returns each choice's text, finish reason and logprobs, the usage, any error
    event, and whether [DONE] came. Sets ``started`` after a few content chunks."""
    req = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}
    out: dict[str, Any] = {"text": {}, "finish": {}, "logprobs": {}, "usage": None, "error": None, "done": False}
    chunks = 0
    with httpx.stream("POST", f"{c.router_url}/v1/{path}", json=req, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for ev in sse_events(r):
            if ev == "[DONE]":
                out["done"] = True
                continue
            if "error" in ev:
                out["error"] = ev["error"]
                continue
            if ev.get("usage"):
                out["usage"] = ev["usage"]
            for ch in ev["choices"]:
                i = ch["index"]
                piece = ch["delta"].get("content", "") if "delta" in ch else ch["text"]
                out["text"][i] = out["text"].get(i, "") + (piece or "")
                if ch.get("finish_reason"):
                    out["finish"][i] = ch["finish_reason"]
                if ch.get("logprobs") and ch["logprobs"].get("content"):
                    out["logprobs"].setdefault(i, []).extend(ch["logprobs"]["content"])
                chunks += 1
                if chunks == 6:
                    started.set()
    started.set()
    return out


def test_kill9_decode_worker_mid_stream_streams_continue_unchanged(healthy: LocalCluster) -> None:
    """kill -9 of the decode worker in the middle of several streams (greedy, n=2 seeded sampling, chat with
    logprobs, sampling with a frequency penalty over a disaggregated prompt, a stop string reached after the
    seam): every stream completes with exactly the text, logprobs, finish reasons and usage of a fault-free
    run."""
    c = healthy
    requests = _migration_requests()
    never = threading.Event()
    reference = [_run_stream(c, path, body, never) for path, body in requests]
    # A stop string that the greedy story reaches late, after the seam.
    text = reference[0]["text"][0]
    requests.append(("completions", {**requests[0][1], "stop": [text[-20:-12]]}))
    reference.append(_run_stream(c, *requests[-1], never))
    assert reference[-1]["finish"] == {0: "stop"}, reference[-1]
    before = router_workers(c)["migrations"]
    started = [threading.Event() for _ in requests]
    runs = [
        _in_thread(lambda path=path, body=body, ev=ev: _run_stream(c, path, body, ev))
        for (path, body), ev in zip(requests, started, strict=True)
    ]
    for ev in started:
        assert ev.wait(30)
    victim_url = max(c.decode_urls, key=lambda u: load(u)["running_requests"])
    assert load(victim_url)["running_requests"] > 0, "the streams ended before the kill"
    victim = part_for(c, victim_url)
    t0 = time.monotonic()
    victim.kill_group()
    for t, _ in runs:
        t.join(60)
        assert not t.is_alive(), "a stream hung after its decode worker died"
    elapsed = time.monotonic() - t0
    assert elapsed < 40, f"streams took {elapsed:.1f}s to end after their decode worker died"
    for (path, _), (_, out), ref in zip(requests, runs, reference, strict=True):
        assert "exc" not in out, out
        got = out["result"]
        assert got["error"] is None and got["done"], got
        assert got["text"] == ref["text"], (path, got["text"], ref["text"])
        assert got["finish"] == ref["finish"], (got["finish"], ref["finish"])
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached tokens vary with the cache
        assert [got["usage"][k] for k in counts] == [ref["usage"][k] for k in counts], (got["usage"], ref["usage"])
        for i, lps in ref["logprobs"].items():
            mine = got["logprobs"][i]
            assert [e["token"] for e in mine] == [e["token"] for e in lps]
            assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(mine, lps)) < 0.05
    migrated = router_workers(c)["migrations"]
    assert migrated["succeeded"] > before["succeeded"] and migrated["failed"] == before["failed"], migrated
    survivors = [u for u in worker_urls(c) if u != victim_url]
    wait_pages_back(*survivors)
    assert_serving(c)  # the other decode worker carries on (the dead one is routed around)
    wait_until(lambda: not router_says_up(c, victim_url), 10, "router marks the dead decode worker down")
    # Restarted on its address (a new NIXL agent under the same name): disaggregated requests through it
    # work, i.e. the prefill workers accept its new handshake.
    restart(victim)
    wait_until(lambda: router_says_up(c, victim_url), 30, "restarted decode worker up in the router")
    before = metric(victim_url, "kvferry_generated_tokens_total")
    for _ in range(6):
        r = completion(c, long_prompt(), max_tokens=3)
        assert r.status_code == 200, r.text
        if metric(victim_url, "kvferry_generated_tokens_total") > before:
            break
    assert metric(victim_url, "kvferry_generated_tokens_total") > before, "nothing went through the restarted decode"
    FAULTS_SURVIVED.append("kill -9 decode mid-stream")


ENGINE_BACK_S = 30.0  # a worker whose engine died serves again within this, by itself (docs/reliability.md)


def _back_by_itself(c: LocalCluster, victim: ManagedProcess, engine: int, killed: float) -> float:
    """The worker whose engine was killed restarts it on its own (same control plane, a new engine process)
    and is routed to again within ENGINE_BACK_S; returns the seconds from the kill to ready."""
    assert victim.proc is not None and victim.url is not None
    worker_pid = victim.proc.pid
    wait_until(
        lambda: httpx.get(f"{victim.url}/ready", timeout=2).status_code == 200,
        ENGINE_BACK_S,
        f"{victim.name} ready again after its engine died",
        interval=0.1,
    )
    took = time.monotonic() - killed
    assert victim.alive() and victim.proc.pid == worker_pid  # nothing restarted the worker itself
    assert engine_pid(worker_pid) != engine
    assert metric(victim.url, "kvferry_engine_restarts_total") == 1 + ENGINE_RESTARTS.get(victim.name, 0)
    ENGINE_RESTARTS[victim.name] = ENGINE_RESTARTS.get(victim.name, 0) + 1
    wait_until(lambda: router_says_up(c, victim.url or ""), 10, "the router routes to it again")
    print(f"\n{victim.name}: engine killed -> worker ready again in {took:.1f} s")
    return took


ENGINE_RESTARTS: dict[str, int] = {}


def test_decode_engine_exit_mid_stream_continues_elsewhere(healthy: LocalCluster) -> None:
    """The decode worker's engine process dies but its control plane lives: the control plane ends the stream
    with a retryable error (common/worker/channel.py), the router continues it on the other worker, and the
    control plane starts a new engine by itself and serves again within ENGINE_BACK_S."""
    c = healthy
    body = {"model": MODEL, "prompt": "Write a long poem about the sea.", "max_tokens": 80, "temperature": 0}
    body["ignore_eos"] = True
    expected = httpx.post(f"{c.router_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    before = router_workers(c)["migrations"]["succeeded"]
    counted = metric(c.router_url, "kvferry_router_migrations_total", '{outcome="succeeded"}')
    with httpx.stream("POST", f"{c.router_url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(r)
        text = "".join(next(events)["choices"][0]["text"] for _ in range(3))  # type: ignore[index]
        victim = part_for(c, wait_until(lambda: _busy(c.decode_urls), 10, "the decode worker streaming"))
        assert victim.proc is not None
        engine = engine_pid(victim.proc.pid)
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        for ev in events:
            if isinstance(ev, dict) and ev["choices"]:
                text += ev["choices"][0]["text"]
    assert text == expected
    assert router_workers(c)["migrations"]["succeeded"] == before + 1
    assert metric(c.router_url, "kvferry_router_migrations_total", '{outcome="succeeded"}') == counted + 1
    # While it restarts, requests succeed on the other decode worker.
    assert_serving(c)
    _back_by_itself(c, victim, engine, killed)
    assert "engine process died; restarting it" in victim.log_tail(200)
    FAULTS_SURVIVED.append("decode engine exit mid-stream, restarted by its worker")


def test_prefill_engine_exit_mid_prefill_is_retried_and_restarted(healthy: LocalCluster) -> None:
    """kill -9 of a prefill worker's engine mid-prefill (the OOM killer's pick): the request in flight is
    retried elsewhere, others succeed meanwhile, and the worker starts a new engine by itself; the decode
    workers handshake with the new NIXL instance behind the same URL and requests go through it again."""
    c = healthy
    t, out, victim_url = _long_prefill_under_way(c)
    victim = part_for(c, victim_url)
    assert victim.proc is not None
    engine = engine_pid(victim.proc.pid)
    os.kill(engine, signal.SIGKILL)
    killed = time.monotonic()
    t.join(90)
    assert not t.is_alive(), "the request hung after its prefill engine died"
    assert "exc" not in out, out
    assert out["result"].status_code == 200, out["result"].text
    assert_serving(c)
    _back_by_itself(c, victim, engine, killed)
    _reach(c, victim_url, done=metric(victim_url, "kvferry_requests_total", '{outcome="done"}') + 1)
    FAULTS_SURVIVED.append("prefill engine exit mid-prefill, restarted by its worker")


def test_stream_that_cannot_continue_ends_with_an_error_event_and_done(healthy: LocalCluster, tmp_path: Path) -> None:
    """A second router over the same workers with migration off: a stream whose decode worker dies after
    content went out under HTTP 200 ends with an OpenAI-shaped error event and [DONE], never just stops."""
    c = healthy
    port = free_port()
    argv = ["--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--redis-url", c.redis_url]
    argv += ["--discovery", "static", "--prefill-urls", ",".join(c.prefill_urls)]
    router = ManagedProcess(
        "router-no-migration",
        kvferry_argv("router", *argv, "--decode-urls", ",".join(c.decode_urls)),
        dict(os.environ, **ENV, KVFERRY_ROUTER_MIGRATION_LIMIT="0"),
        tmp_path / "router.log",
        url=f"http://127.0.0.1:{port}",
    )
    router.start()
    victim: ManagedProcess | None = None
    try:
        wait_ready([router], 60)
        body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 300, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60) as r:
            assert r.status_code == 200
            events = sse_events(r)
            text = "".join(next(events)["choices"][0]["text"] for _ in range(3))  # type: ignore[index]
            victim = part_for(c, wait_until(lambda: _busy(c.decode_urls), 10, "the decode worker streaming"))
            victim.kill_group()
            rest = list(events)
        assert text and rest[-1] == "[DONE]", rest[-3:]
        err = assert_openai_error(rest[-2])
        assert err["code"] == "upstream_error" and "generation failed" in err["message"], err
    finally:
        router.stop()
    assert victim is not None
    wait_pages_back(*[u for u in worker_urls(c) if u != victim.url])
    restart(victim)
    FAULTS_SURVIVED.append("stream that cannot continue ends with an error event")


@contextmanager
def long_stream_under_way(c: LocalCluster) -> Iterator[Iterator[dict[str, Any] | str]]:
    """A long streaming completion that has produced tokens (the decode pod is busy with it); yields the rest
    of its events. Leaving the block closes the client's connection."""
    body = {
        "model": MODEL,
        "prompt": long_prompt(),
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{c.router_url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r)
        for _ in range(3):
            next(events)
        assert _busy(c.decode_urls) is not None
        yield events


def test_kill9_router_mid_stream(healthy: LocalCluster) -> None:
    c = healthy
    assert c.router is not None
    with long_stream_under_way(c) as events:
        c.router.kill_group()
        t0 = time.monotonic()
        with pytest.raises(httpx.HTTPError):
            for _ev in events:
                pass
        assert time.monotonic() - t0 < 10
    # The workers notice the dropped stream by themselves and free the request: pages back on all.
    took = wait_pages_back(*worker_urls(c), timeout=10)
    assert took < 5, took
    restart(c.router)
    wait_all_up(c)
    FAULTS_SURVIVED.append("kill -9 router mid-stream")


def test_router_replica_keeps_serving_when_the_other_is_killed(healthy: LocalCluster, tmp_path: Path) -> None:
    """Two routers over one fleet share only Redis (the prefix index) and the workers: killing one mid-stream
    loses its own streams only; the other's stream completes with the fault-free text and it keeps serving."""
    c = healthy
    assert c.router is not None
    port = free_port()
    argv = ["--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--redis-url", c.redis_url]
    argv += ["--discovery", "static", "--prefill-urls", ",".join(c.prefill_urls)]
    replica = ManagedProcess(
        "router-replica",
        kvferry_argv("router", *argv, "--decode-urls", ",".join(c.decode_urls)),
        dict(os.environ, **ENV),
        tmp_path / "router.log",
        url=f"http://127.0.0.1:{port}",
    )
    replica.start()
    try:
        wait_ready([replica], 60)
        body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 120, "temperature": 0}
        expected = httpx.post(f"{replica.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60)
        assert expected.status_code == 200
        stream_body = {**body, "ignore_eos": True, "stream": True}
        with long_stream_under_way(c) as lost:
            with httpx.stream("POST", f"{replica.url}/v1/completions", json=stream_body, timeout=60) as r:
                assert r.status_code == 200
                events = sse_events(r)
                text = "".join(next(events)["choices"][0]["text"] for _ in range(2))  # type: ignore[index]
                c.router.kill_group()
                with pytest.raises(httpx.HTTPError):
                    for _ev in lost:
                        pass
                for ev in events:
                    if isinstance(ev, dict) and ev["choices"]:
                        text += ev["choices"][0]["text"]
        assert text == expected.json()["choices"][0]["text"]
        again = httpx.post(f"{replica.url}/v1/completions", json={**body, "max_tokens": 8}, timeout=60)
        assert again.status_code == 200
        wait_pages_back(*worker_urls(c), timeout=15)
    finally:
        replica.stop()
        restart(c.router)
        wait_all_up(c)
    FAULTS_SURVIVED.append("kill -9 one of two routers")


# ---- Redis -----------------------------------------------------------------------------------------
def test_redis_killed_and_restarted(healthy: LocalCluster) -> None:
    c = healthy
    assert c.redis is not None and c.redis.proc is not None
    r = redis.Redis.from_url(c.redis_url, socket_timeout=2)
    pods = [f"local-{role}-{i}" for role, n in (("prefill", 2), ("decode", 2)) for i in range(n)]
    shared = long_prompt(600)
    assert completion(c, shared + " First question?", max_tokens=2).status_code == 200
    wait_until(lambda: all(r.keys(f"kvf:*:hb:{p}") for p in pods), 10, "every pod's heartbeat in Redis")
    holders_before = [p for p in pods if any(r.scard(k) for k in r.keys(f"kvf:*:pod:{p}:blocks"))]
    assert holders_before, "no pod published any block"

    os.kill(c.redis.proc.pid, signal.SIGKILL)
    c.redis.proc.wait(10)
    try:
        # Routing degrades to load only: every request still succeeds, none waits on Redis.
        for q in ("Second question?", "Third question?"):
            t0 = time.monotonic()
            resp = completion(c, shared + " " + q, max_tokens=2)
            assert resp.status_code == 200, resp.text
            assert time.monotonic() - t0 < 20
        resp = completion(c, "Hello, my name is", max_tokens=3)
        assert resp.status_code == 200
        assert router_workers(c)["prefix_index"] == "unavailable"
    finally:
        c.start_redis()

    # Redis is back, empty: the workers notice the vanished heartbeat and republish their caches.
    def refilled() -> bool:
        return all(r.keys(f"kvf:*:hb:{p}") for p in pods) and all(
            any(r.scard(k) for k in r.keys(f"kvf:*:pod:{p}:blocks")) for p in holders_before
        )

    wait_until(refilled, 30, "the index to refill after the Redis restart", interval=0.2)
    live = {m.decode() for k in r.keys("kvf:*:pods") for m in r.smembers(k)}
    assert set(pods) <= live, live

    # The router notices by itself; prefix routing resumes (the pod holding the shared prefix gets it).
    def index_ok() -> bool:
        completion(c, long_prompt(), max_tokens=1)  # short prompts skip the index lookup
        return router_workers(c)["prefix_index"] == "ok"

    wait_until(index_ok, 30, "router prefix index ok again", interval=0.5)
    resp = completion(c, shared + " Last question?", max_tokens=2)
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 500
    r.close()
    FAULTS_SURVIVED.append("redis killed and restarted")


# ---- clients that go away ------------------------------------------------------------------------
def test_client_disconnect_mid_stream_aborts_on_both_workers(healthy: LocalCluster) -> None:
    c = healthy
    aborted = _count_outcome(c.decode_urls, "abort")
    with long_stream_under_way(c):
        pass  # the client hangs up here, mid-stream
    took = abort_times(worker_urls(c), timeout=5)  # the response is closed: the connection is gone
    assert max(took.values()) < 1.5, f"abort took {took}"
    wait_pages_back(*worker_urls(c))
    # The worker counts what it finished by outcome, what the caller gave up on included.
    wait_until(lambda: _count_outcome(c.decode_urls, "abort") == aborted + 1, 5, "the abort counted")
    FAULTS_SURVIVED.append("client disconnect mid-stream")


def _raw_post(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Sends a POST on a raw socket and returns it unread (so the test can hang up at any moment)."""
    u = urlsplit(url)
    data = json.dumps(body).encode()
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_mid_prefill_aborts_on_both_workers(healthy: LocalCluster, stream: bool) -> None:
    """The client hangs up while its long prompt is still being prefilled on a prefill pod (before any
    response byte): both the prefill pod and the decode pod drop the request within about a second."""
    c = healthy
    aborted = {
        role: _count_outcome(urls, "abort") for role, urls in (("decode", c.decode_urls), ("prefill", c.prefill_urls))
    }
    body = {"model": MODEL, "prompt": long_prompt(800), "max_tokens": 50, "temperature": 0, "stream": stream}
    s = _raw_post(c.router_url, "/v1/completions", body)
    try:
        wait_until(
            lambda: next((u for u in c.prefill_urls if load(u)["running_requests"]), None),
            60,
            "prefill under way",
            interval=0.02,
        )
        assert _busy(c.decode_urls) is not None  # the decode pod holds pages reserved for it
    finally:
        s.close()
    took = abort_times(worker_urls(c), timeout=5)
    assert max(took.values()) < 1.5, f"abort took {took}"
    # Pages the prefill pod might still have been writing are held back briefly on the decode pod.
    wait_pages_back(*worker_urls(c))
    # Both workers count the request they gave up as aborted (the prefill one's is a prefill-only request).
    for role, urls in (("decode", c.decode_urls), ("prefill", c.prefill_urls)):
        want = aborted[role] + 1
        wait_until(lambda u=urls, n=want: _count_outcome(u, "abort") == n, 5, f"the {role} abort counted")
    FAULTS_SURVIVED.append(f"client disconnect mid-prefill ({'stream' if stream else 'non-stream'})")


def _count_outcome(urls: list[str], outcome: str) -> float:
    return sum(metric(u, "kvferry_requests_total", f'{{outcome="{outcome}"}}') for u in urls)


HANGUPS = int(os.environ.get("KVFERRY_TEST_HANGUPS", "200"))  # scale up for a soak: KVFERRY_TEST_HANGUPS=2000


def _hang_up(c: LocalCluster, rng: random.Random) -> str:
    """One client that goes away at a random moment of its request's life: a long (disaggregated) or short
    (local) prompt, streamed or not, on a raw socket closed after a random delay (from right after sending,
    before dispatch, to mid-decode) or on an httpx stream closed after its first few chunks. Returns how
    the request ended for the client (for the test's tally)."""
    stream = rng.random() < 0.5
    prompt = long_prompt(300) if rng.random() < 0.5 else f"[{uuid.uuid4().hex[:8]}] Tell me about the sea."
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    if stream and rng.random() < 0.3:
        try:
            with httpx.stream("POST", f"{c.router_url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}"
                for i, _ev in enumerate(sse_events(r)):
                    if i >= rng.randrange(1, 6):
                        break
            return "httpx closed mid-stream"
        except httpx.HTTPError as e:
            return type(e).__name__
    s = _raw_post(c.router_url, "/v1/completions", {**body, "stream": stream})
    try:
        time.sleep(rng.choice((0.0, rng.uniform(0, 0.05), rng.uniform(0, 0.4), rng.uniform(0, 1.5))))
    finally:
        s.close()
    return "raw socket closed"


def _nothing_held(c: LocalCluster) -> list[str]:
    """Everything the router and the workers hold for requests, by their own endpoints; empty when nothing."""
    held = []
    rw = router_workers(c)
    if rw["inflight"]:
        held.append(f"router inflight {rw['inflight']}")
    if metric(c.router_url, "kvferry_router_inflight_requests"):
        held.append("router metric inflight")
    for w in rw["workers"]:
        if w["inflight_requests"] or w["inflight_tokens"]:
            held.append(
                f"router counts {w['inflight_requests']} requests / {w['inflight_tokens']} tokens on {w['url']}"
            )
    for u in worker_urls(c):
        ld = load(u)
        if ld["running_requests"] or ld["waiting_requests"] or ld.get("live_requests"):
            held.append(
                f"{u} running {ld['running_requests']} waiting {ld['waiting_requests']} live {ld.get('live_requests')}"
            )
        if ld["free_pages"] != ld["total_pages"]:
            held.append(f"{u} free pages {ld['free_pages']}/{ld['total_pages']}")
        if metric(u, "kvferry_running_requests"):
            held.append(f"{u} metric running")
    return held


def test_hangups_at_random_moments_leave_nothing_behind(healthy: LocalCluster) -> None:
    """Hundreds of clients hang up at random moments (before dispatch, during the reservation, the remote-
    prefill handshake, the prefill, the KV transfer, the decode; streamed and not; disaggregated and local):
    within a few seconds nothing is held anywhere (router and worker counts, running requests, KV pages, by
    their own endpoints), and then requests are served, none refused with 429 by leaked counts."""
    c = healthy
    seed = int(os.environ.get("KVFERRY_TEST_SEED", "0")) or random.randrange(1 << 30)
    rngs = [random.Random(seed + i) for i in range(HANGUPS)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        outcomes = list(pool.map(lambda rng: _hang_up(c, rng), rngs))
    tally = {k: outcomes.count(k) for k in set(outcomes)}
    print(f"\nhang-ups (seed {seed}): {tally}")
    t0 = time.monotonic()
    while held := _nothing_held(c):
        assert time.monotonic() - t0 < 10, f"still held 10 s after {HANGUPS} hang-ups (seed {seed}): {held}"
        time.sleep(0.2)
    print(f"nothing held {time.monotonic() - t0:.1f} s after the last hang-up")
    # No lock-out: a burst of normal requests, short and long, is answered (not 429). They are batch-class
    # (priority 1), which the TTFT prediction never refuses, so a 429 here could only come from leaked counts.
    with ThreadPoolExecutor(max_workers=8) as pool:
        prompts = [long_prompt() if i % 2 else "The sea is" for i in range(8)]
        rs = list(pool.map(lambda p: completion(c, p, max_tokens=3, priority=1), prompts))
    assert [r.status_code for r in rs] == [200] * 8, [r.text for r in rs if r.status_code != 200]
    FAULTS_SURVIVED.append(f"{HANGUPS} hang-ups at random moments")


def test_abort_the_client_did_not_ask_for_ends_its_stream_with_an_error(healthy: LocalCluster) -> None:
    """Someone else aborts a client's request on its decode worker (``/internal/abort``): the client's stream
    ends with an OpenAI-shaped error event and [DONE], never a ``finish_reason: "stop"`` that would make the
    cut look like a normal finish."""
    c = healthy
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    finishes, errors, done = [], [], False
    with httpx.stream("POST", f"{c.router_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for i, ev in enumerate(sse_events(r)):
            if ev == "[DONE]":
                done = True
                continue
            if "error" in ev:
                errors.append(ev["error"])
                continue
            finishes += [ch["finish_reason"] for ch in ev["choices"] if ch.get("finish_reason")]
            if i == 2:  # under way: its decode worker knows it as <response id>-0
                for u in c.decode_urls:
                    a = httpx.post(f"{u}/internal/abort", json={"req_id": f"{ev['id']}-0"}, timeout=5)
                    assert a.status_code < 300, a.text
    assert done and not finishes, finishes
    assert len(errors) == 1 and "aborted" in assert_openai_error({"error": errors[0]})["message"], errors
    wait_pages_back(*worker_urls(c))
    assert_serving(c)


def test_decode_worker_contacts_only_its_prefill_peers(healthy: LocalCluster) -> None:
    """A generate request naming a prefill worker the decode worker was not configured with (a listener of the
    caller's, or a known worker's address with a path of the caller's) is refused 403 and nothing is sent
    there; the pages and counts are untouched."""
    c = healthy
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(1.0)
    port = listener.getsockname()[1]
    try:
        for url in (f"http://127.0.0.1:{port}", f"{c.prefill_urls[0]}/internal/evil"):
            body = {
                "req_id": uuid.uuid4().hex,
                "token_ids": [1] * 300,
                "sampling": {"max_tokens": 2},
                "prefill_url": url,
            }
            r = httpx.post(f"{c.decode_urls[0]}/internal/generate", json=body, timeout=10)
            assert r.status_code == 403, r.text
            assert assert_openai_error(r.json())["code"] == "unknown_prefill_peer"
        with pytest.raises(TimeoutError):
            listener.accept()  # the decode worker never called it
    finally:
        listener.close()
    wait_pages_back(*worker_urls(c))
    assert_serving(c)


# ---- a worker that stops answering ----------------------------------------------------------------
def _stop_group(part: ManagedProcess, sig: int) -> None:
    assert part.proc is not None
    os.killpg(part.proc.pid, sig)  # the control plane and its engine child (one session per part)


def test_sigstopped_decode_worker_is_routed_around(healthy: LocalCluster) -> None:
    c = healthy
    client = openai.OpenAI(base_url=f"{c.router_url}/v1", api_key="none", max_retries=0, timeout=60)
    args: dict[str, Any] = dict(
        model=MODEL,
        prompt="Write a long poem about the sea.",
        max_tokens=150,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    expected = client.completions.create(**args).choices[0].text
    it = iter(client.completions.create(**args, stream=True))
    texts = [next(it).choices[0].text]
    victim_url = wait_until(lambda: _busy(c.decode_urls), 10, "the decode worker running the stream")
    victim = part_for(c, victim_url)
    _stop_group(victim, signal.SIGSTOP)
    try:
        # Once the router declares the frozen worker down (long before the 120 s inter-token deadline), the
        # stream goes on on the other decode worker, as if nothing happened.
        t0 = time.monotonic()
        finish = None
        for chunk in it:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
        assert time.monotonic() - t0 < 30
        assert finish == "length" and "".join(texts) == expected
        wait_until(lambda: not router_says_up(c, victim_url), 15, "router marks the frozen worker down")
        # New requests go around it, short and long, and they are not slowed down by it.
        for _ in range(4):
            t1 = time.monotonic()
            assert_serving(c)
            assert time.monotonic() - t1 < 20
        others = [u for u in worker_urls(c) if u != victim_url]
        wait_pages_back(*others)
    finally:
        _stop_group(victim, signal.SIGCONT)
    wait_until(lambda: router_says_up(c, victim_url), 15, "the worker back up after SIGCONT")
    FAULTS_SURVIVED.append("SIGSTOP decode")


def _long_prefill_under_way(c: LocalCluster) -> tuple[threading.Thread, dict[str, Any], str]:
    """A long completion sent in a thread, returned once a prefill worker is running it (with that worker's URL)."""
    t, out = _in_thread(lambda: completion(c, long_prompt(800), max_tokens=3, timeout=120))
    victim_url = wait_until(
        lambda: next((u for u in c.prefill_urls if load(u)["running_requests"]), None),
        60,
        "prefill under way",
        interval=0.02,
    )
    return t, out, victim_url


def test_sigstopped_prefill_worker_mid_prefill_is_retried_elsewhere(healthy: LocalCluster) -> None:
    c = healthy
    t, out, victim_url = _long_prefill_under_way(c)
    victim = part_for(c, victim_url)
    _stop_group(victim, signal.SIGSTOP)
    try:
        t.join(60)
        assert not t.is_alive(), "the request hung on a frozen prefill worker"
        assert "exc" not in out, out
        r = out["result"]
        # Declared down, its request is retried before the first token on the other prefill pod.
        assert r.status_code == 200, r.text
        assert out["seconds"] < 40, out
        assert not router_says_up(c, victim_url)
        assert_serving(c)
    finally:
        _stop_group(victim, signal.SIGCONT)
    wait_until(lambda: router_says_up(c, victim_url), 15, "the worker back up after SIGCONT")
    FAULTS_SURVIVED.append("SIGSTOP prefill")


def test_frozen_prefill_engine_is_given_up_for_lack_of_progress(healthy: LocalCluster) -> None:
    """The prefill worker's engine freezes mid-prefill while its control plane keeps answering (so the router
    still believes it up): its heartbeats stop, the decode side gives up after PREFILL_STALL_S instead of
    waiting out a fixed deadline, and the router retries the request on the other prefill worker."""
    from decode_worker.remote_prefill import PREFILL_STALL_S

    c = healthy
    t, out, victim_url = _long_prefill_under_way(c)
    victim = part_for(c, victim_url)
    assert victim.proc is not None
    engine = engine_pid(victim.proc.pid)
    os.kill(engine, signal.SIGSTOP)
    try:
        t.join(90)
        assert not t.is_alive(), "the request hung on a frozen prefill engine"
        assert "exc" not in out, out
        assert out["result"].status_code == 200, out["result"].text
        assert PREFILL_STALL_S <= out["seconds"] < PREFILL_STALL_S + 30, out
        assert router_says_up(c, victim_url)  # its control plane still answers: only progress told
    finally:
        os.kill(engine, signal.SIGCONT)
    FAULTS_SURVIVED.append("frozen prefill engine")
