"""Prefill -> decode over NIXL between real worker processes (CPU, UCX, the packaged SmolLM2)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.helpers import wait_pages_back
from tests.workers import (
    generate,
    generate_body,
    give_up_during_remote_prefill,
    run_concurrently,
    start_worker,
    wait_ready,
)

CHUNK = 64  # KVFERRY_MAX_PREFILL_TOKENS of the test workers (tests/workers.py)


@pytest.fixture(scope="module")
def workers(redis_server):
    env = {"KVFERRY_DEBUG_CHECKSUMS": "1"}
    p = start_worker("prefill", redis_server, env=env)
    d = start_worker("decode", redis_server, env=env)
    try:
        wait_ready(p, d)
        yield p, d
    finally:
        p.stop()
        d.stop()


def test_disaggregated_equals_local_prefill(workers, smol_tokenizer):
    p, d = workers
    texts = [
        "The capital of France is",
        "Write a short story about a robot who learns to paint. " * 14,  # several chunks
        "List the planets of the solar system in order from the sun:",
        "def quicksort(arr):\n    " * 12,
    ]
    prompts = [smol_tokenizer.encode(t) for t in texts]
    assert max(len(x) for x in prompts) > 2 * CHUNK
    local = run_concurrently(lambda ids: generate(d, ids, None), [(x,) for x in prompts])
    remote = run_concurrently(lambda ids: generate(d, ids, p), [(x,) for x in prompts])
    for (lt, _), (rt, rev) in zip(local, remote):
        assert rt == lt
        assert rev[-1]["finish_reason"] == "length"
        assert rev[0]["kv_verified"] is True  # page checksums matched on both sides
    wait_pages_back(p, d)


def test_shared_prefix_prefills_only_suffix(workers, smol_tokenizer):
    p, d = workers
    system = "You are a careful assistant for a railway company. Answer briefly and politely. " * 4
    first = smol_tokenizer.encode(system + "When does the first train leave?")
    second = smol_tokenizer.encode(system + "Can I bring my bicycle on board?")
    _, ev1 = generate(d, first, p)
    tokens2, ev2 = generate(d, second, p)
    shared = len(smol_tokenizer.encode(system)) // 16 * 16
    assert ev2[0]["cached_tokens"] >= shared - 16 > 0
    assert ev2[0]["prompt_tokens"] == len(second)
    local2, _ = generate(d, second, None)
    assert tokens2 == local2
    wait_pages_back(p, d)


def test_abort_mid_transfer_returns_pages(workers, smol_tokenizer):
    p, d = workers
    ids = smol_tokenizer.encode("An extremely long document about rivers and mountains. " * 120)
    give_up_during_remote_prefill(d, p, ids)
    wait_pages_back(p, d)


def test_kill9_prefill_mid_request(workers, redis_server, smol_tokenizer):
    _, d = workers
    victim = start_worker("prefill", redis_server)
    wait_ready(victim)
    ids = smol_tokenizer.encode("A very long legal contract with many clauses and sub-clauses. " * 150)
    result: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        result["tokens"], result["events"] = generate(d, ids, victim, timeout=60)
        result["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 20
    while victim.load()["running_requests"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    victim.kill9()
    t.join(60)
    assert not t.is_alive()
    last = result["events"][-1]
    assert last["finish_reason"] == "error" and "prefill" in last["error"]
    assert result["tokens"] == []
    assert result["seconds"] < 30
    wait_pages_back(d)


def test_layout_mismatch_refused_and_restart_rehandshaken(workers, redis_server, smol_tokenizer):
    _, d = workers
    ids = smol_tokenizer.encode("Hello there, how are you today?")
    odd = start_worker("prefill", redis_server, env={"KVFERRY_PAGE_SIZE": "32"})
    try:
        wait_ready(odd)
        tokens, events = generate(d, ids, odd)
        assert tokens == [] and events[-1]["finish_reason"] == "error"
        assert "page_size" in events[-1]["error"]
    finally:
        odd.stop()
    wait_pages_back(d)
    # A prefill worker restarted on the same address is a new NIXL instance: it must be handshaken anew.
    first = start_worker("prefill", redis_server)
    wait_ready(first)
    expected, _ = generate(d, ids, None)
    assert generate(d, ids, first)[0] == expected
    port = first.port
    first.kill9()
    second = start_worker("prefill", redis_server, port=port)
    try:
        wait_ready(second)
        assert generate(d, ids, second)[0] == expected
    finally:
        second.stop()
    wait_pages_back(d)


def test_fp8_kv_prefill_to_fp8_decode_equals_local_and_float32_decode_refuses_it(workers, redis_server, smol_tokenizer):
    """FP8 KV pages (KVFERRY_KV_DTYPE=fp8_e4m3) move over NIXL as they are: half the bytes of bf16 per token,
    the same tokens as the FP8 decode worker's own prefill. A float32 decode worker refuses the FP8 prefill
    worker at the handshake, naming the KV format, and loses no page."""
    _, d = workers
    fp8 = {"KVFERRY_KV_DTYPE": "fp8_e4m3", "KVFERRY_DEBUG_CHECKSUMS": "1"}
    p8 = start_worker("prefill", redis_server, env=fp8)
    d8 = start_worker("decode", redis_server, env=fp8)
    try:
        wait_ready(p8, d8)
        ids = smol_tokenizer.encode("Describe the water cycle in four short steps for a school class. " * 12)
        assert len(ids) > 2 * CHUNK  # several chunks, several writes
        local, _ = generate(d8, ids, None)
        remote, events = generate(d8, ids, p8)
        assert remote == local and len(remote) == 24
        assert events[0]["kv_verified"] is True
        tokens, events = generate(d, ids, p8)
        assert tokens == [] and events[-1]["finish_reason"] == "error"
        error = events[-1]["error"]
        assert "dtype" in error and "float8_e4m3fn" in error and "KVFERRY_KV_DTYPE" in error, error
        wait_pages_back(p8, d8, d)
    finally:
        p8.stop()
        d8.stop()


def test_internal_endpoints_reject_bad_messages(workers):
    p, d = workers
    r = httpx.post(f"{d.url}/internal/generate", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(
        f"{d.url}/internal/generate",
        json={"protocol_version": 99, "req_id": "x", "token_ids": [1], "sampling": {}},
        timeout=10,
    )
    assert r.status_code == 400 and "protocol_version" in r.json()["error"]["message"]
    r = httpx.post(f"{p.url}/internal/prefill", json={"req_id": "x"}, timeout=10)
    assert r.status_code == 400
    r = httpx.post(
        f"{d.url}/internal/generate", json={"req_id": "y", "token_ids": [1] * 9000, "sampling": {}}, timeout=10
    )
    # Past the context and past one request's share of the pool: the edge's share check answers first, naming both.
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "request_too_large" and "prompt 9000" in err["message"], err
    assert httpx.get(f"{d.url}/health", timeout=5).status_code == 200


def test_second_delivery_of_a_live_request_is_409_duplicate(workers, smol_tokenizer):
    """A request delivered twice (a POST resent on a fresh connection after its first copy arrived) is refused
    as a duplicate (409, code duplicate_request: the router retries under a new id), not as a bad request;
    the first copy runs on, and every page comes back."""
    p, d = workers
    ids = smol_tokenizer.encode("Tell me about the moon.")
    for prefill in (None, p):
        body = generate_body(ids, prefill.url if prefill else None, max_tokens=48)
        with httpx.stream("POST", f"{d.url}/internal/generate", json=body, timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(line for line in lines if line)  # the first copy is live
            again = httpx.post(f"{d.url}/internal/generate", json=body, timeout=30)
            assert again.status_code == 409, again.text
            assert again.json()["error"]["code"] == "duplicate_request"
            tokens = [t for line in lines if line for t in json.loads(line).get("token_ids", [])]
        assert tokens  # the first copy streamed on to its end
    wait_pages_back(p, d)
