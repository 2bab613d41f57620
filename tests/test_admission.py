"""Admission by what a request can take, against a real router and a real decode worker (CPU, packaged model):
a request's KV is n x (prompt + max_tokens), reserved for its whole output. One that can never fit a worker's
per-request share gets 400 naming the numbers, one that could fit but not now 429 + Retry-After, and a normal
request beside any mix of accepted large ones runs at once (router/decision/admission.py); the worker refuses past its
share itself for callers that bypass the router (decode_worker/routes.py)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from common.devcluster.cluster import LocalCluster
from tests.helpers import assert_openai_error, running_cluster, wait_pages_back, wait_until
from tests.test_reliability import MODEL, router_workers, sse_events, worker_urls

pytestmark = pytest.mark.timeout(300)

PAGES, PAGE_SIZE, SHARE = 128, 16, 0.5
POOL = PAGES * PAGE_SIZE  # 2,048 tokens of KV on the one decode worker
CAP = int(POOL * SHARE)  # the most one request may reserve: 1,024
ENV = {
    "KVFERRY_NUM_PAGES": str(PAGES),
    "KVFERRY_PAGE_SIZE": str(PAGE_SIZE),
    "KVFERRY_MAX_REQUEST_KV_SHARE": str(SHARE),
    "KVFERRY_MAX_PREFILL_TOKENS": "64",
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(prefill=0, decode=1, env=ENV) as c:
        yield c


def router_sees_pool_free(cluster: LocalCluster) -> bool:
    """The router's own view (what its admission reads): every decode worker's last /load shows the pool free."""
    ws = [w for w in router_workers(cluster)["workers"] if w["role"] == "decode"]
    return bool(ws) and all(w["free_pages"] == w["total_pages"] and not w["inflight_requests"] for w in ws)


@pytest.fixture
def idle(cluster: LocalCluster) -> Iterator[LocalCluster]:
    wait_pages_back(*worker_urls(cluster))
    wait_until(lambda: router_sees_pool_free(cluster), 30, "the router's view of a free pool")
    yield cluster
    wait_pages_back(*worker_urls(cluster), timeout=30)


def chat_body(max_tokens: int, n: int = 1, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] Tell me a long story."}],
        "max_tokens": max_tokens,
        "n": n,
        "ignore_eos": True,
        "stream": stream,
    }


@dataclass
class HeldStream:
    """A streaming request kept open (its first chunk read) until `release` is set, then closed: a large request
    in flight for as long as the test needs it, whatever the CPU's speed."""

    body: dict[str, Any]
    status: int = 0
    retry_after: str | None = None
    error: dict[str, Any] | None = None
    streaming: threading.Event = field(default_factory=threading.Event)  # the first chunk came
    answered: threading.Event = field(default_factory=threading.Event)  # status known
    release: threading.Event = field(default_factory=threading.Event)
    finished_early: bool = False  # the stream ended before it was released

    def run(self, url: str) -> None:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{url}/v1/chat/completions", json=self.body) as r,
        ):
            self.status = r.status_code
            self.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                self.error = assert_openai_error(json.loads(r.read()))
                self.answered.set()
                return
            events = sse_events(r)
            next(events)
            self.answered.set()
            self.streaming.set()
            for ev in events:
                if ev == "[DONE]":
                    self.finished_early = not self.release.is_set()
                    return
                if self.release.is_set():
                    return  # closing the stream is the client hanging up: the worker aborts the request


def test_request_that_can_never_fit_gets_400_naming_the_numbers(idle: LocalCluster) -> None:
    r = httpx.post(f"{idle.router_url}/v1/chat/completions", json=chat_body(max_tokens=1000, n=16), timeout=30)
    assert r.status_code == 400, r.text
    err = assert_openai_error(r.json())
    assert err["code"] == "request_too_large" and err["param"] == "max_tokens"
    assert "n=16" in err["message"] and f"{CAP} tokens" in err["message"], err["message"]
    # One choice alone past the share is refused the same way.
    r = httpx.post(f"{idle.router_url}/v1/chat/completions", json=chat_body(max_tokens=CAP), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large", r.text


def test_more_choices_than_the_decode_workers_take_at_once_get_400_naming_the_limit(idle: LocalCluster) -> None:
    """The one decode worker takes 64 calls in its batch and 64 waiting (its queue is as long as its batch):
    130 choices could never all be placed, so no retry would cure a 429; a 400 says why."""
    body = {"model": MODEL, "prompt": ["a", "b"], "n": 65, "max_tokens": 1}
    r = httpx.post(f"{idle.router_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = assert_openai_error(r.json())
    assert err["code"] == "too_many_choices" and err["param"] == "n", err
    assert "130 concurrent" in err["message"] and "at once: 128" in err["message"], err["message"]


def test_worker_refuses_past_its_share_for_callers_that_bypass_the_router(idle: LocalCluster) -> None:
    decode = idle.decode_urls[0]
    assert httpx.get(f"{decode}/load", timeout=5).json()["max_request_tokens"] == CAP
    body = {"req_id": uuid.uuid4().hex, "token_ids": [1, 2, 3], "sampling": {"max_tokens": CAP, "ignore_eos": True}}
    r = httpx.post(f"{decode}/internal/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = assert_openai_error(r.json())
    assert err["code"] == "request_too_large" and f"at most {CAP} tokens" in err["message"], err["message"]


def test_normal_request_runs_beside_any_mix_of_large_ones(idle: LocalCluster) -> None:
    url = idle.router_url
    # Each within the share; together far more than the pool (2,048 tokens): the first is admitted, the rest
    # would each leave less free than they take, so they get 429 instead of queueing on the worker, where they
    # (and everything behind them) would wait for the first to finish its 900 tokens.
    mix = [chat_body(900, stream=True), chat_body(450, n=2, stream=True), chat_body(600, stream=True)]
    held = [HeldStream(b) for b in mix]
    threads = [threading.Thread(target=h.run, args=(url,), daemon=True) for h in held]
    try:
        threads[0].start()
        assert held[0].answered.wait(60) and held[0].status == 200, held[0].error
        for t in threads[1:]:
            t.start()
        for h in held:
            assert h.answered.wait(60), "no answer to a large request"
            assert h.status in (200, 429), (h.status, h.error)
            if h.status == 429:
                assert h.retry_after is not None and int(h.retry_after) >= 1
                assert h.error is not None and h.error["type"]
        refused = [h for h in held if h.status == 429]
        assert refused, "every large request was taken: the pool cannot hold them all"
        # A normal request meanwhile: admitted at once, finished while the large ones still stream.
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=8), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        streaming = [h for h in held if h.status == 200]
        assert all(not h.finished_early for h in streaming), "a large request ended before the normal one did"
    finally:
        for h in held:
            h.release.set()
        for t in threads:
            t.join(60)
    wait_pages_back(*worker_urls(idle), timeout=30)


def test_large_request_is_admitted_again_once_the_pool_has_room(idle: LocalCluster) -> None:
    """429 means "not now": the same request succeeds once nothing else holds the pool."""
    first = HeldStream(chat_body(900, stream=True))
    t = threading.Thread(target=first.run, args=(idle.router_url,), daemon=True)
    t.start()
    try:
        assert first.answered.wait(60) and first.status == 200, first.error
        body = chat_body(max_tokens=900)
        r = httpx.post(f"{idle.router_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 429 and r.headers.get("retry-after"), r.text
    finally:
        first.release.set()
        t.join(60)
    wait_pages_back(*worker_urls(idle), timeout=30)
    wait_until(lambda: router_sees_pool_free(idle), 30, "the router's view of a free pool")
    again = HeldStream(chat_body(900, stream=True))
    t = threading.Thread(target=again.run, args=(idle.router_url,), daemon=True)
    t.start()
    try:
        wait_until(lambda: again.answered.is_set(), 60, "an answer to the retried large request")
        assert again.status == 200, again.error
    finally:
        again.release.set()
        t.join(60)
