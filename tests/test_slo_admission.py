"""Admission by predicted TTFT against a real worker (CPU): the worker publishes what predicts a new request's
TTFT on /load; the router refuses, with 429 and Retry-After and without routing it anywhere, an interactive
request it predicts will miss its class's TTFT target while the worker's queue is loaded with long prompts;
batch requests are admitted all the while; once the queue drains, interactive requests are admitted again.
Nothing here is timed: the target is far below what the loaded queue takes and far above an idle prefill."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from common.config import RouterConfig
from router.decision.discovery import StaticDiscovery
from router.settings import RouterOptions
from router.surface.tokenizer import ModelInfo, RouterTokenizer
from tests.helpers import assert_openai_error, wait_until
from tests.workers import WorkerProc, generate, start_router_thread, start_worker, wait_ready

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m-instruct"
SLO = "interactive:ttft=1500ms,itl=2s,p=99;batch:ttft=none,itl=5s,p=99"
ENV = {
    "KVFERRY_SLO_CLASSES": SLO,
    "KVFERRY_NUM_PAGES": "1024",
    "KVFERRY_MAX_PREFILL_TOKENS": "256",
    "KVFERRY_PAGE_SIZE": "16",
}
HEADER = "x-kvferry-class"


@pytest.fixture(scope="module")
def worker(redis_server) -> Iterator[WorkerProc]:
    w = start_worker("decode", redis_server, env=ENV)
    try:
        wait_ready(w)
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def router(worker: WorkerProc, smol_path, redis_server) -> Iterator[str]:
    from router.app import create_app

    app = create_app(
        RouterConfig(model=MODEL, redis_url=redis_server, slo_classes=SLO),
        RouterOptions(poll_interval_s=0.05),
        tokenizer=RouterTokenizer.from_dir(smol_path),
        model_info=ModelInfo.from_dir(MODEL, smol_path),
        discovery=StaticDiscovery([], [worker.url]),
    )
    server = start_router_thread(app)
    try:
        yield server.url
    finally:
        server.stop()


def completion(router: str, prompt: str | list[int], cls: str | None = None, max_tokens: int = 2) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{router}/v1/completions", json=body, headers={HEADER: cls} if cls else {}, timeout=300)


def metric(router: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{router}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    assert m is not None, f"{name}{labels} not exported"
    return float(m.group(1))


def decisions(router: str) -> dict[str, int]:
    return httpx.get(f"{router}/router/workers", timeout=10).json()["decisions"]


def test_shed_by_predicted_ttft_and_admitted_once_capacity_returns(
    worker: WorkerProc, router: str, smol_tokenizer
) -> None:
    # Warm-up through the router (an unmeasured worker predicts nothing, so nothing is refused): the step-time
    # model times prompt chunks beside and without decoding.
    for i in range(4):
        r = completion(router, f"Warm-up {i}: " + "rivers and mountains of the north. " * 60, max_tokens=8)
        assert r.status_code == 200, (r.text, worker.load())
    load = wait_until(lambda: (ld := worker.load())["step_coefficients"] and ld, 60, "a fitted step model")
    # /load carries the prediction's inputs.
    assert load["step_coefficients"]["per_prefill_token_s"] > 0
    assert load["step_chunk_tokens"] > 0
    assert set(load["queued_ahead_tokens"]) == {"interactive", "batch"}
    assert {"decode_rows", "decode_context"} <= set(load)
    assert metric(router, "kvferry_router_slo_requests_total", '{slo_class="interactive"}') >= 4
    assert metric(router, "kvferry_router_slo_shed_total", '{slo_class="batch"}') == 0  # declared from 0

    # Load the worker's queue with long prompts sent to it directly (the router does not see them placed).
    ids = smol_tokenizer.encode("An extremely long document about rivers and mountains. " * 110)[:1000]
    results: list[Any] = []

    def long_one(k: int) -> None:
        results.append(generate(worker, [k + 1, *ids[1:]], None, max_tokens=1, timeout=300))

    threads = [threading.Thread(target=long_one, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: worker.load()["queued_ahead_tokens"]["interactive"] >= 6000, 60, "a loaded queue")
        before = decisions(router)
        r = completion(router, "What is the capital of France?", "interactive")
        assert r.status_code == 429, r.text
        err = assert_openai_error(r.json())
        assert err["code"] == "rate_limit_exceeded" and "interactive" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
        after = decisions(router)
        # Refused before any routing decision: nothing was sent to a worker.
        assert after.get("rejected-ttft", 0) == before.get("rejected-ttft", 0) + 1
        assert {k: v for k, v in after.items() if k != "rejected-ttft"} == {
            k: v for k, v in before.items() if k != "rejected-ttft"
        }
        assert metric(router, "kvferry_router_slo_shed_total", '{slo_class="interactive"}') >= 1
        # A batch request is never refused for TTFT: it queues behind the long prompts and is served.
        r = completion(router, "What is the capital of Italy?", "batch")
        assert r.status_code == 200, r.text
    finally:
        for t in threads:
            t.join(300)
    assert len(results) == 12
    # Capacity is back: an interactive request is admitted (the router sees the empty queue within a poll).
    wait_until(lambda: worker.load()["queued_prefill_tokens"] == 0, 60, "the queue drained")
    r = wait_until(
        lambda: (x := completion(router, "What is the capital of Spain?", "interactive")).status_code == 200 and x,
        30,
        "an interactive request admitted again",
    )
    assert r.json()["choices"][0]["text"] is not None
    assert metric(router, "kvferry_router_slo_requests_total", '{slo_class="batch"}') >= 1
    assert metric(router, "kvferry_router_ttft_prediction_ratio_count") >= 1


def test_a_request_names_its_class_by_header_or_priority(router: str) -> None:
    """The x-kvferry-class header names a declared class (400 naming the declared ones otherwise); vLLM's
    `priority` steps from the default class (1: one class lower, batch here); the class is counted per request."""
    r = completion(router, "Hello", cls="gold")
    err = assert_openai_error(r.json())
    assert r.status_code == 400 and err["param"] == HEADER, r.text
    assert "unknown SLO class 'gold'" in err["message"] and "interactive, batch" in err["message"], err
    before = metric(router, "kvferry_router_slo_requests_total", '{slo_class="batch"}')
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0, "priority": 1}
    r = httpx.post(f"{router}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert metric(router, "kvferry_router_slo_requests_total", '{slo_class="batch"}') == before + 1
    r = httpx.post(f"{router}/v1/completions", json={**body, "priority": "high"}, timeout=60)
    assert r.status_code == 400 and assert_openai_error(r.json())["param"], r.text
