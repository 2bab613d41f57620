"""Mixed workers (`kvferry mixed`: decode, prefill locally, prefill for peers) on CPU, over real NIXL, a real
redis-server and the packaged SmolLM2: every placement gives the answer a local prefill gives, pages come
back on every side, and an adaptive router moves requests between placements as load moves."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from common.config import RouterConfig
from common.devcluster.cluster import LocalCluster
from common.slo import DEFAULT_SLO_SPEC
from router.decision.discovery import StaticDiscovery
from router.server_thread import ServerThread
from router.settings import RouterOptions
from router.surface.tokenizer import ModelInfo, RouterTokenizer
from tests.helpers import engine_pid, running_cluster, wait_pages_back, wait_until
from tests.workers import generate, give_up_during_remote_prefill, run_concurrently, start_router_thread

MODEL = "smollm2-135m-instruct"
CHUNK = 64
ENV = {
    "KVFERRY_NUM_PAGES": "512",
    "KVFERRY_MAX_RUNNING": "16",
    "KVFERRY_MAX_PREFILL_TOKENS": str(CHUNK),
    "KVFERRY_DEBUG_CHECKSUMS": "1",
    "KVFERRY_LOG_LEVEL": "WARNING",
    # The GPU loop's shape (step N+1 launched before step N is processed) on the CPU: a peer's prefill and the
    # engine's own decode batch then interleave as they do on a GPU. Greedy outputs equal the overlap-off
    # engine's (tests/test_scheduler.py), so the comparisons below hold either way.
    "KVFERRY_OVERLAP": "on",
    # The ITL cap on: peer prefills are chunked beside this engine's own decoding, as on a GPU under load.
    "KVFERRY_ITL_TARGET_MS": "5",
}


@dataclass(frozen=True)
class Worker:
    """A worker of the cluster as tests/workers.py's helpers see one (its URL and its /load)."""

    url: str

    def load(self) -> dict:
        return httpx.get(f"{self.url}/load", timeout=5).json()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(prefill=1, decode=1, mixed=2, env=ENV, wait_up=False) as c:
        yield c


@pytest.fixture(scope="module")
def fleet(cluster: LocalCluster) -> tuple[Worker, Worker, Worker, Worker]:
    """(mixed A, mixed B, prefill P, decode D)."""
    a, b = (Worker(u) for u in cluster.mixed_urls)
    return a, b, Worker(cluster.prefill_urls[0]), Worker(cluster.decode_urls[0])


def _prompts(tok) -> list[list[int]]:
    texts = [
        "The capital of France is",
        "Write a short story about a robot who learns to paint. " * 14,  # several chunks
        "def quicksort(arr):\n    " * 12,
    ]
    ids = [tok.encode(t) for t in texts]
    assert max(len(x) for x in ids) > 2 * CHUNK
    return ids


def test_mixed_workers_report_their_role_and_the_router_serves_through_them(cluster: LocalCluster) -> None:
    for url in cluster.mixed_urls:
        assert httpx.get(f"{url}/load", timeout=5).json()["role"] == "mixed"
    ready = httpx.get(f"{cluster.router_url}/ready", timeout=5).json()
    assert ready["workers"] == {"prefill": 1, "decode": 1, "mixed": 2}
    r = httpx.post(
        f"{cluster.router_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    view = httpx.get(f"{cluster.router_url}/router/workers", timeout=5).json()
    assert view["placement"]["mode"] == "adaptive"  # `kvferry up --mixed` places adaptively


def test_every_placement_gives_the_local_answer(fleet, smol_tokenizer) -> None:
    """Local on a mixed pod; mixed -> mixed both ways; mixed -> decode pod; prefill pod -> mixed. All at once,
    so each mixed engine decodes its own requests while it prefills for its peers."""
    a, b, p, d = fleet
    prompts = _prompts(smol_tokenizer)
    local = [generate(a, ids, None)[0] for ids in prompts]
    placements = [(a, b), (b, a), (d, a), (a, p), (b, None)]
    jobs = [(dec, ids, pre) for dec, pre in placements for ids in prompts]
    results = run_concurrently(generate, jobs)
    for (dec, ids, pre), (tokens, events) in zip(jobs, results, strict=True):
        assert tokens == local[prompts.index(ids)], (dec.url, pre.url if pre else None)
        assert events[-1]["finish_reason"] == "length"
        if pre is not None:
            assert events[0]["kv_verified"] is True  # page checksums matched on both sides
    sent = httpx.get(f"{a.url}/internal/stats", timeout=5).json()["transfer"]
    assert sent["transfers"] >= 2 * len(prompts) and sent["writes_in_flight"] == 0
    wait_pages_back(a, b, p, d)


def test_abort_while_a_mixed_worker_prefills_for_a_peer_returns_pages(fleet, smol_tokenizer) -> None:
    a, b, _, _ = fleet
    ids = smol_tokenizer.encode("An extremely long document about rivers and mountains. " * 120)
    give_up_during_remote_prefill(b, a, ids)  # A prefills B's request
    wait_pages_back(a, b)


# ---- adaptive placement over a prefill pod and a mixed pod ------------------------------------------------
def _side_router(
    cluster: LocalCluster, smol_path, prefill: str, mixed: str, slo_classes: str = DEFAULT_SLO_SPEC, **opts: object
) -> ServerThread:
    return _side_router_over(cluster, smol_path, [mixed], [prefill], slo_classes, **opts)


def _side_router_over(
    cluster: LocalCluster,
    smol_path,
    mixed: list[str],
    prefill: list[str] = (),
    slo_classes: str = DEFAULT_SLO_SPEC,
    **opts: object,
) -> ServerThread:
    """A router in this process over some of the cluster's workers, with its own options and SLO classes."""
    from router.app import create_app

    app = create_app(
        RouterConfig(model=MODEL, redis_url=cluster.redis_url, slo_classes=slo_classes),
        RouterOptions(**{"placement": "adaptive", **opts}),  # type: ignore[arg-type]
        tokenizer=RouterTokenizer.from_dir(smol_path),
        model_info=ModelInfo.from_dir(MODEL, smol_path),
        discovery=StaticDiscovery(list(prefill), [], mixed),
    )
    return start_router_thread(app)


def _router_view(router_url: str, worker_url: str) -> dict:
    """The router's entry for one worker in `/router/workers`: what its latest poll of that worker read."""
    workers = httpx.get(f"{router_url}/router/workers").json()["workers"]
    return next(w for w in workers if w["url"] == worker_url)


def _rates_known(router_url: str) -> bool:
    rates = httpx.get(f"{router_url}/router/workers").json()["placement"]["workers"]
    return all(r["prefill_tokens_per_s"] > 0 for r in rates.values())


def test_adaptive_router_moves_requests_between_placements_as_load_moves(
    cluster: LocalCluster, fleet, smol_tokenizer, smol_path
) -> None:
    """Idle, the mixed pod prefills a request itself (no transfer, no second pod); while it decodes a batch, a
    local prefill would cost that batch more than the ITL target, so the request goes to the prefill pod. The
    request's class makes the choice certain on any CPU: a tiny ITL target and no TTFT target, with a transfer
    assumed slow (idle, a disaggregated TTFT is always the longer)."""
    a, _, p, _ = fleet
    router = _side_router(
        cluster,
        smol_path,
        p.url,
        a.url,
        "interactive:ttft=none,itl=1ms,p=99",  # this router's targets for the class (the workers know its name)
        placement="adaptive",
        transfer_tokens_per_s=1.0,
        poll_interval_s=0.05,
    )
    try:
        warm = [
            smol_tokenizer.encode(f"Topic {i}: " + "a long warm-up prompt about many things. " * 40) for i in range(3)
        ]
        deadline = time.monotonic() + 90
        while not _rates_known(router.url):
            assert time.monotonic() < deadline, httpx.get(f"{router.url}/router/workers").json()["placement"]
            run_concurrently(
                lambda ids, pre: generate(a, ids, pre, max_tokens=1), [(x, y) for x in warm for y in (None, p)]
            )

        # What the placement model reads is visible: in the router's view and in the worker's own metrics.
        seen = httpx.get(f"{router.url}/router/workers").json()["placement"]["workers"][a.url]
        assert seen["prefill_step_tokens_per_s"] > 0 and seen["prefill_chunk_tokens"] > 0, seen
        metrics = httpx.get(f"{a.url}/metrics").text
        speed = next(ln for ln in metrics.splitlines() if ln.startswith("kvferry_prefill_step_tokens_per_second "))
        assert float(speed.split()[1]) > 0, speed

        prompt = "Explain briefly why the sky is blue. " * 8
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}

        def decisions() -> dict[str, int]:
            return httpx.get(f"{router.url}/router/workers").json()["decisions"]

        def ask() -> tuple[str, str]:
            before = decisions()
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            moved = [k for k, v in decisions().items() if v != before.get(k, 0)]
            assert len(moved) == 1, moved
            return moved[0], r.json()["choices"][0]["text"]

        wait_pages_back(a, p)
        idle_reason, idle_text = ask()

        # A long decode on A, started directly, keeps A's batch busy while the router places the next request.
        busy_ids = smol_tokenizer.encode("Count from one to one thousand: one, two, three,")
        long_decode = threading.Thread(target=generate, args=(a, busy_ids, None, 400))
        long_decode.start()
        wait_until(lambda: _router_view(router.url, a.url)["running_requests"], 30, "the router to see A decoding")
        busy_reason, busy_text = ask()
        long_decode.join(300)
    finally:
        router.stop()
    assert idle_reason == "adaptive-local", idle_reason
    assert busy_reason.startswith("adaptive-disaggregated"), busy_reason
    assert busy_text == idle_text  # greedy: the placement changes nothing the client sees
    wait_pages_back(a, p)


# ---- last in the module: it kills a worker of the shared cluster -----------------------------------------
def _stream_on_one_of(
    router_url: str, body: dict, worker_urls: tuple[str, ...]
) -> tuple[threading.Thread, dict[str, tuple[str, str | None]], str]:
    """Starts a stream in the background; once it has begun, the worker decoding it (its text lands in
    out["run"] when the thread ends)."""
    started = threading.Event()
    out: dict[str, tuple[str, str | None]] = {}
    t = threading.Thread(target=lambda: out.update(run=_stream_text(router_url, body, started)))
    t.start()
    assert started.wait(60)
    victim_url = max(worker_urls, key=lambda u: Worker(u).load()["running_requests"])
    assert Worker(victim_url).load()["running_requests"] > 0, "the stream ended before the kill"
    return t, out, victim_url


def _stream_text(url: str, body: dict, started: threading.Event | None = None) -> tuple[str, str | None]:
    """Streams a completion; (text, finish reason). `started` is set at the first text."""
    text, finish = "", None
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
            if text and started is not None:
                started.set()
    return text, finish


def test_mixed_engine_killed_mid_stream_stream_moves_and_the_worker_heals(
    cluster: LocalCluster, fleet, smol_path
) -> None:
    """kill -9 of a mixed worker's engine process only (its control plane lives): the stream moves to the
    other mixed worker with the fault-free text, and the worker starts a new engine by itself and is routed
    to again within 30 s (docs/reliability.md, Engine restart)."""
    from tests.test_reliability import _back_by_itself

    a, b, _, _ = fleet
    router = _side_router_over(cluster, smol_path, [a.url, b.url])
    try:
        body = {"model": MODEL, "prompt": "Describe a walk along a river.", "max_tokens": 120, "temperature": 0}
        body["ignore_eos"] = True
        reference = _stream_text(router.url, body)
        t, out, victim_url = _stream_on_one_of(router.url, body, (a.url, b.url))
        victim = next(p for p in cluster.workers if p.url == victim_url)
        assert victim.proc is not None
        engine = engine_pid(victim.proc.pid)
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        t.join(90)
        assert not t.is_alive(), "the stream hung after its decode engine died"
    finally:
        router.stop()
    assert out["run"] == reference, (out["run"], reference)
    _back_by_itself(cluster, victim, engine, killed)


def test_stream_survives_its_mixed_decode_worker_dying(cluster: LocalCluster, fleet, smol_path) -> None:
    """kill -9 of the mixed worker decoding a stream: the router moves the stream to the other mixed worker,
    and the client reads exactly the text of a fault-free run."""
    a, b, _, _ = fleet
    router = _side_router_over(cluster, smol_path, [a.url, b.url])
    try:
        body = {
            "model": MODEL,
            "prompt": "Tell a long story about a lighthouse keeper.",
            "max_tokens": 160,
            "temperature": 0,
            "ignore_eos": True,
        }
        reference = _stream_text(router.url, body)
        t, out, victim_url = _stream_on_one_of(router.url, body, (a.url, b.url))
        next(p for p in cluster.workers if p.url == victim_url).kill_group()
        t.join(90)
        assert not t.is_alive(), "the stream hung after its decode worker died"
        migrations = httpx.get(f"{router.url}/router/workers").json()["migrations"]
    finally:
        router.stop()
    assert out["run"] == reference, (out["run"], reference)
    assert migrations["succeeded"] >= 1 and migrations["failed"] == 0, migrations
