"""A client's hang-up aborts its prompt wherever it is: queued for pages on the decode worker, prefilling on the
prefill worker, or its KV on the way. Real local cluster (redis-server, 1 prefill + 1 decode worker, the
router), real NIXL between the workers.

The storm: more long prompts than the decode pool can reserve pages for at once (the router admits what fits and
answers the rest 429), most of the pool reserved while they prefill; every client hangs up mid-prefill. Within seconds every page is free and nothing runs or waits
on either worker (the prefill worker stops at its next chunk; the decode worker frees a reservation at once,
or as soon as the prefill worker's writes into it have settled), and long prompts are served again.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from common.devcluster.cluster import LocalCluster
from tests.helpers import load, running_cluster, wait_pages_back, wait_until
from tests.test_reliability import MODEL, _raw_post, completion, long_prompt
from tests.workers import generate_body, start_worker, wait_ready

pytestmark = pytest.mark.timeout(300)

PROMPTS = 8  # ~1,000 tokens each: three fit the decode pool's reservations at once, the rest are refused (429)
IDLE_WITHIN_S = 5.0
ENV = {
    "KVFERRY_NUM_PAGES": "256",  # 4,096 tokens of KV per worker
    "KVFERRY_MAX_PREFILL_TOKENS": "128",  # a prompt takes several chunks: a window to hang up mid-prefill
    "KVFERRY_PAGE_SIZE": "16",
    "KVFERRY_ROUTER_LOCAL_PREFIX_FRACTION": "2",
    "KVFERRY_ROUTER_DISAGG_MIN_PROMPT_TOKENS": "256",
}


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(prefill=1, decode=1, env=ENV) as c:
        yield c


def held(c: LocalCluster) -> dict[str, dict[str, Any]]:
    """What each worker still holds: pages not free, requests running or waiting (empty when nothing)."""
    out = {}
    for u in c.prefill_urls + c.decode_urls:
        ld = load(u)
        if ld["free_pages"] != ld["total_pages"] or ld["running_requests"] or ld["waiting_requests"]:
            keys = ("free_pages", "total_pages", "running_requests", "waiting_requests")
            out[u] = {k: ld[k] for k in keys}
    return out


def test_hang_up_storm_mid_prefill_frees_everything_within_seconds(cluster: LocalCluster) -> None:
    c = cluster
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stream": True}
    socks = [_raw_post(c.router_url, "/v1/completions", {**body, "prompt": long_prompt(900)}) for _ in range(PROMPTS)]
    try:
        # Mid-prefill, with most of the decode pool reserved for the prompts being prefilled.
        wait_until(lambda: load(c.prefill_urls[0])["running_requests"] > 0, 120, "a prefill under way", 0.02)
        wait_until(
            lambda: load(c.decode_urls[0])["free_pages"] < load(c.decode_urls[0])["total_pages"] // 2,
            60,
            "the decode pool reserved for the prompts",
            0.02,
        )
    finally:
        for s in socks:
            s.close()
    t0 = time.monotonic()
    while still := held(c):
        took = time.monotonic() - t0
        assert took <= IDLE_WITHIN_S, f"still held {took:.1f} s after the last hang-up: {still}"
        time.sleep(0.05)
    print(f"\nidle {time.monotonic() - t0:.2f} s after {PROMPTS} hang-ups")
    # Long prompts are served again at once (no 429 from pages nobody wants any more).
    with ThreadPoolExecutor(max_workers=2) as pool:
        rs = list(pool.map(lambda _: completion(c, long_prompt(300), max_tokens=2, timeout=120), range(2)))
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]


def test_request_waiting_for_pages_is_dropped_when_its_caller_leaves(redis_server, smol_tokenizer) -> None:
    """The decode pool is full with one remote prefill's reservation; a second request waits for pages. Its
    stream opens at once (the engine answers when it queues it, not when pages free up), so a caller that
    leaves is heard while it waits: nothing of it is ever reserved or prefilled, and every page comes back."""
    # 2,048 tokens: one ~1,500-token prompt fills it (a share of the whole pool, so the worker's edge lets it in)
    env = {"KVFERRY_NUM_PAGES": "128", "KVFERRY_MAX_REQUEST_KV_SHARE": "1"}
    p = start_worker("prefill", redis_server, env=env)
    d = start_worker("decode", redis_server, env=env)
    try:
        wait_ready(p, d)
        ids = smol_tokenizer.encode("Write a long story about a lighthouse keeper and the sea. " * 110)[:1500]
        with httpx.stream("POST", f"{d.url}/internal/generate", json=generate_body(ids, p.url, 16), timeout=60) as a:
            assert a.status_code == 200
            wait_until(lambda: p.load()["running_requests"] == 1, 60, "the first prompt prefilling", 0.02)
            t0 = time.monotonic()
            with httpx.stream(
                "POST", f"{d.url}/internal/generate", json=generate_body(ids[::-1], p.url, 16), timeout=10
            ) as b:
                assert b.status_code == 200
                assert time.monotonic() - t0 < 5, "the stream waited for pages before it opened"
        wait_pages_back(p, d, timeout=IDLE_WITHIN_S)
        assert p.load()["running_requests"] == 0
    finally:
        p.stop()
        d.stop()
