"""A busy worker does not look idle: while one long prompt's prefill step runs (seconds on the CPU, no engine
snapshot meanwhile), the worker's /load and gauges count the request it accepted, its prompt tokens and its
pages, which is what the router's placement and admission read."""

from __future__ import annotations

import json
import threading

import httpx

from tests.helpers import wait_pages_back
from tests.workers import generate_body, start_worker, wait_ready

PROMPT_TOKENS = 1536  # one prefill step (KVFERRY_MAX_PREFILL_TOKENS below): seconds on one CPU thread
PAGE_SIZE = 16


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


def test_load_counts_work_accepted_during_a_long_step(redis_server) -> None:
    w = start_worker("decode", redis_server, env={"KVFERRY_MAX_PREFILL_TOKENS": "2048"})
    try:
        wait_ready(w)
        idle = w.load()
        assert idle["running_requests"] == 0 and idle["free_pages"] == idle["total_pages"]
        ids = [(7 * i) % 40000 + 100 for i in range(PROMPT_TOKENS)]
        first_token = threading.Event()
        samples: list[dict] = []
        gauges: list[str] = []
        with httpx.Client(timeout=10) as probe:

            def poll() -> None:
                while not first_token.is_set():
                    ld = probe.get(f"{w.url}/load").json()
                    if not first_token.is_set():
                        samples.append(ld)
                    if len(gauges) < 1:
                        gauges.append(probe.get(f"{w.url}/metrics").text)

            body = generate_body(ids, max_tokens=2)
            with httpx.stream("POST", f"{w.url}/internal/generate", json=body, timeout=300) as r:
                assert r.status_code == 200  # the engine accepted it: from here on it is the worker's work
                poller = threading.Thread(target=poll, daemon=True)
                poller.start()
                lines = r.iter_lines()
                first = json.loads(next(line for line in lines if line))
                first_token.set()
                poller.join(10)
                rest = [json.loads(x) for x in lines if x]
        assert first["token_ids"] and rest[-1]["finish_reason"] == "length"
        # The step was long next to a /load round trip: the worker answered many times while it ran.
        assert len(samples) >= 5, len(samples)
        pages = -(-PROMPT_TOKENS // PAGE_SIZE)
        for ld in samples:
            assert ld["running_requests"] + ld["waiting_requests"] >= 1, ld
            assert ld["free_pages"] <= ld["total_pages"] - pages, ld
        # Its prompt counts as queued prefill work until the engine's first snapshot after the step says it is
        # done (the last few answers, before its first token reached this client).
        queued = [ld["queued_prefill_tokens"] for ld in samples]
        assert queued[0] >= PROMPT_TOKENS and sum(q >= PROMPT_TOKENS for q in queued) >= 5, queued[:10]
        assert queued == sorted(queued, reverse=True), "queued prefill work rose again mid-step"
        assert _gauge(gauges[0], "kvferry_running_requests") >= 1
        assert _gauge(gauges[0], "kvferry_prefill_queued_tokens") >= PROMPT_TOKENS
        wait_pages_back(w)  # and once it finished, nothing is counted any more (the next snapshot says so)
        assert w.load()["queued_prefill_tokens"] == 0
    finally:
        w.kill9()
