"""Transfer races forced on the CPU, between real worker processes over real NIXL and HTTP.

The prefill worker runs with the fault hook `KVFERRY_FAULT_WRITE_DELAY_S`: every KV write it posts lands
that many seconds late and cannot be called back, like a write stuck in flight. Both workers checksum the
pages of every transfer (`KVFERRY_DEBUG_CHECKSUMS=1`). The safety property under test: the decode worker
never frees a page that a write can still land in, and the prefill worker never frees a page a write still
reads. Observed from outside: while the prefill worker reports a write in flight, the decode worker has
not given the pages back; the next request on the decode worker (on those very pages, had they been freed)
still produces the local greedy output; the idle page-ledger check finds nothing; every page comes back.
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.helpers import assert_openai_error, engine_pid, engine_pipe_queued, wait_pages_back, wait_until
from tests.workers import (
    WorkerProc,
    generate,
    generate_body,
    prefill_layout,
    prefill_request,
    run_concurrently,
    start_worker,
    wait_ready,
)

DELAY_S = 4.0  # longer than the 2 s the decode worker used to wait before reusing given-up pages


@pytest.fixture(scope="module")
def pair(redis_server: str) -> Iterator[tuple[WorkerProc, WorkerProc]]:
    checks = {"KVFERRY_DEBUG_CHECKSUMS": "1"}
    p = start_worker("prefill", redis_server, env={**checks, "KVFERRY_FAULT_WRITE_DELAY_S": str(DELAY_S)})
    d = start_worker("decode", redis_server, env=checks)
    try:
        wait_ready(p, d)
        yield p, d
    finally:
        p.stop()
        d.stop()


def _prompt(tokenizer: Any, words: int, tag: str) -> list[int]:
    return tokenizer.encode(
        f"[{tag}] " + " ".join(("harbor", "lantern", "meadow", "quarry")[i % 4] for i in range(words))
    )


def _writes_in_flight(p: WorkerProc) -> int:
    return int(httpx.get(f"{p.url}/internal/stats", timeout=5).json()["transfer"]["writes_in_flight"])


def _all_free(d: WorkerProc) -> bool:
    ld = d.load()
    return ld["free_pages"] == ld["total_pages"] and ld["running_requests"] == 0


def _metric(w: WorkerProc, name: str) -> float:
    for line in httpx.get(f"{w.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported by {w.role}")


def _assert_pages_held_while_writes_fly(p: WorkerProc, d: WorkerProc, timeout: float = 3 * DELAY_S) -> None:
    """Until the prefill worker's writes have all settled, the decode worker must not have freed the pages.
    The decode worker is read first: "all free" seen before "a write in flight" means both held at once."""
    deadline = time.monotonic() + timeout
    while True:
        freed = _all_free(d)
        flying = _writes_in_flight(p)
        assert not (freed and flying), "decode pages were freed while a prefill write to them was in flight"
        if freed and not flying:
            return
        assert time.monotonic() < deadline, f"pages not back: decode {d.load()}, writes in flight {flying}"
        time.sleep(0.05)


def _stream_generate(d: WorkerProc, body: dict[str, Any], timeout: float = 60) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{d.url}/internal/generate", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line]


def test_abort_while_writes_in_flight(pair: tuple[WorkerProc, WorkerProc], smol_tokenizer: Any) -> None:
    p, d = pair
    victim = _prompt(smol_tokenizer, 300, "abort")
    reuse = _prompt(smol_tokenizer, 300, "reuse")
    expected, _ = generate(d, reuse, None, max_tokens=24)  # local prefill: the reference output
    body = generate_body(victim, p.url, max_tokens=8)
    with httpx.stream("POST", f"{d.url}/internal/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        wait_until(lambda: _writes_in_flight(p), 30, "the prefill worker to post a write", interval=0.02)
    # The client hung up with writes in flight. The next request on the decode worker would get the very
    # pages the late writes land in, had they been freed.
    tokens, events = generate(d, reuse, None, max_tokens=24)
    assert tokens == expected and events[-1]["finish_reason"] == "length"
    _assert_pages_held_while_writes_fly(p, d)
    wait_pages_back(p, d)


def test_late_write_after_the_decode_deadline(pair: tuple[WorkerProc, WorkerProc], smol_tokenizer: Any) -> None:
    p, d = pair
    victim = _prompt(smol_tokenizer, 200, "late")
    reuse = _prompt(smol_tokenizer, 200, "after")
    expected, _ = generate(d, reuse, None, max_tokens=24)
    body = generate_body(victim, p.url, max_tokens=8, kv_timeout_s=2.0)  # shorter than the writes take to land
    events = _stream_generate(d, body)
    assert events[-1]["finish_reason"] == "error" and "deadline" in events[-1]["error"], events[-1]
    assert _writes_in_flight(p) > 0, "the late writes should still be in flight when the request failed"
    tokens, _ = generate(d, reuse, None, max_tokens=24)
    assert tokens == expected
    _assert_pages_held_while_writes_fly(p, d)
    wait_pages_back(p, d)


def test_two_choices_sharing_a_prefix_on_one_prefill_pod(
    pair: tuple[WorkerProc, WorkerProc], smol_tokenizer: Any
) -> None:
    """n=2: the same prompt twice at once on one prefill pod. Whichever finishes second finds its prefix
    cached by the first and frees its duplicate pages: only after its own (late) writes read them. A third
    prompt prefilled meanwhile would be handed those pages and overwrite them under the late writes."""
    p, d = pair
    shared = _prompt(smol_tokenizer, 200, "twins")
    other = _prompt(smol_tokenizer, 200, "third")
    local = [generate(d, ids, None)[0] for ids in (shared, other)]
    results = run_concurrently(lambda ids: generate(d, ids, p), [(shared,), (shared,), (other,)])
    for (tokens, events), want in zip(results, [local[0], local[0], local[1]], strict=True):
        assert events[0].get("kv_verified") is True, events[-1]
        assert tokens == want
    wait_pages_back(p, d)
    for w in (p, d):
        assert _metric(w, "kvferry_kv_integrity_violations_total") == 0
    assert _metric(d, "kvferry_kv_forced_releases_total") == 0


# ---- a peer that sends a malformed notice -----------------------------------------------------------
def _bad_prefill_main(port_q: Any) -> None:
    """A prefill worker that answers the handshake honestly, then ends every request with a malformed notice
    (and some garbage) over real NIXL, and holds the request's stream open."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import torch

    from common.kv.pool import KVLayout, KVPool
    from common.transfer.agent import KVTransferAgent

    agent = KVTransferAgent(
        "bad-prefill", KVPool(KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16, dtype=torch.float32), 2)
    )
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/internal/cancel":
                self.send_response(204)
                self.end_headers()
                return
            if self.path == "/internal/handshake":
                with lock:
                    agent.nixl.add_remote_agent(base64.b64decode(body["agent_metadata_b64"]))
                self._json({"agent_name": agent.name, "instance_id": agent.instance_id, "layout": body["layout"]})
                return
            peer = body["dst_agent"]
            with lock:
                for msg in (
                    b"\xff not json",
                    json.dumps({"req_id": "nobody-asked", "outcome": "landed", "token": 1}).encode(),
                    json.dumps({"req_id": body["req_id"], "outcome": "landed", "token": "the capital"}).encode(),
                ):
                    agent.nixl.send_notif(peer, msg)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.end_headers()
            try:
                for _ in range(300):  # until the decode worker hangs up
                    self.wfile.write(b"\n")
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_q.put(server.server_address[1])
    server.serve_forever()


def test_malformed_notice_fails_one_request_and_the_engine_keeps_serving(
    pair: tuple[WorkerProc, WorkerProc], smol_tokenizer: Any
) -> None:
    p, d = pair
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    bad = ctx.Process(target=_bad_prefill_main, args=(port_q,), daemon=True)
    bad.start()
    try:
        bad_url = f"http://127.0.0.1:{port_q.get(timeout=60)}"
        bystander_ids = _prompt(smol_tokenizer, 40, "bystander")
        expected, _ = generate(d, bystander_ids, None, max_tokens=48)
        out: dict[str, Any] = {}
        bystander = threading.Thread(
            target=lambda: out.update(zip(("tokens", "events"), generate(d, bystander_ids, None, max_tokens=48)))
        )
        bystander.start()
        body = {
            "req_id": uuid.uuid4().hex,
            "token_ids": _prompt(smol_tokenizer, 60, "victim"),
            "prefill_url": bad_url,
            "sampling": {"max_tokens": 8},
        }
        events = _stream_generate(d, body, timeout=30)
        assert events[-1]["finish_reason"] == "error" and "malformed" in events[-1]["error"], events[-1]
        bystander.join(60)
        assert out["tokens"] == expected  # the request running beside it was untouched
        # The misbehaving peer may still write into the failed request's pages: they stay held while it lives,
        # however many turns the engine takes (each one polls the request's transfer session).
        turns = d.load()["loop_turns"]
        later = wait_until(
            lambda: (ld := d.load())["loop_turns"] >= turns + 200 and ld["running_requests"] == 0 and ld,
            30,
            "200 engine turns with nothing running",
        )
        assert later["free_pages"] < later["total_pages"]
    finally:
        bad.kill()
        bad.join(10)
    wait_pages_back(d)  # its process is gone: nothing of it can land any more
    tokens, events = generate(d, _prompt(smol_tokenizer, 60, "next"), p)
    assert events[-1]["finish_reason"] == "length" and events[0].get("kv_verified") is True
    assert _metric(d, "kvferry_kv_integrity_violations_total") == 0


def test_a_request_cancelled_before_it_arrived_is_refused(pair: tuple[WorkerProc, WorkerProc]) -> None:
    """A decode worker that gave a request up before its prefill request reached the peer cancels it there: the
    peer refuses it when it arrives (410), a refusal that tells the decode worker, on the request's own
    exchange, that no write of it can come, so its pages are freed then, and a late arrival never writes."""
    p, d = pair
    dst = {"dst_agent": "decode-agent", "dst_instance_id": "instance"}
    rid = uuid.uuid4().hex
    r = httpx.post(f"{p.url}/internal/cancel", json={**dst, "req_ids": [rid]}, timeout=10)
    assert r.status_code == 204, r.text
    late = {
        "req_id": rid,
        "token_ids": [1, 2, 3],
        "sampling": {"max_tokens": 1},
        "dst_agent": dst["dst_agent"],
        "dst_instance_id": dst["dst_instance_id"],
        "dst_pages": [0],
        "deadline_s": 10,
    }
    r = httpx.post(f"{p.url}/internal/prefill", json=late, timeout=10)
    assert r.status_code == 410, r.text
    assert r.json()["error"]["code"] == "cancelled"
    assert _writes_in_flight(p) == 0


@contextmanager
def _own_decode_agent(p: WorkerProc, tag: str) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """This process as a decode agent of its own (a small KV pool, a NIXL agent) handshaken with the prefill
    worker ``p``: (agent, pool, layout)."""
    import torch

    from common.kv.pool import KVLayout, KVPool
    from common.transfer.agent import KVTransferAgent

    layout = prefill_layout(p.url)
    dims = (layout["num_layers"], layout["num_kv_heads"], layout["head_dim"], layout["page_size"])
    pool = KVPool(KVLayout(*dims, getattr(torch, layout["dtype"])), 8)
    agent = KVTransferAgent(f"{tag}-{uuid.uuid4().hex[:8]}", pool, model_id=layout["model_id"])
    try:
        hs = {
            "agent_name": agent.name,
            "instance_id": agent.instance_id,
            "agent_metadata_b64": agent.metadata_b64(),
            "pool_info_b64": agent.pool_info_b64(),
            "layout": layout,
        }
        assert httpx.post(f"{p.url}/internal/handshake", json=hs, timeout=10).status_code == 200
        yield agent, pool, layout
    finally:
        agent.close()


def test_a_second_copy_of_a_live_prefill_leaves_the_first_alone(
    pair: tuple[WorkerProc, WorkerProc], smol_tokenizer: Any
) -> None:
    """This process is a decode agent of its own (a small pool) with a prefill registered on the peer, its writes
    landing late. A second copy of it to the same agent is refused 409 duplicate_request; the decode worker's
    request under the same id is refused as another worker's (nothing registered for it: it fails at once, with
    no new handshake, its pages back). The first exchange keeps its stream and ends with its KV in our pool."""
    p, d = pair
    generate(d, _prompt(smol_tokenizer, 20, "warm"), p, max_tokens=2)  # the decode worker knows the peer
    handshakes = _metric(d, "kvferry_kv_handshake_seconds_count")
    with _own_decode_agent(p, "dup") as (agent, pool, layout):
        ids = _prompt(smol_tokenizer, 60, "twice")
        pages = list(range(-(-len(ids) // layout["page_size"])))
        first = prefill_request(agent, ids, pages, 30)
        with httpx.stream(
            "POST", f"{p.url}/internal/prefill", json=first, timeout=httpx.Timeout(10, read=20)
        ) as stream:
            assert stream.status_code == 200
            again = httpx.post(f"{p.url}/internal/prefill", json=first, timeout=10)
            assert again.status_code == 409 and again.json()["error"]["code"] == "duplicate_request", again.text
            events = _stream_generate(d, {**generate_body(ids, p.url, max_tokens=8), "req_id": first["req_id"]})
            assert events[-1]["finish_reason"] == "error" and "in use" in events[-1]["error"], events[-1]
            lines = [json.loads(line) for line in stream.iter_lines() if line]
        assert lines[-1].get("done") is True, lines
        assert pool.kv[: len(pages)].abs().sum() > 0  # the first copy's KV landed where it asked
        assert _metric(d, "kvferry_kv_handshake_seconds_count") == handshakes
    wait_pages_back(p, d)


def test_a_request_id_live_for_one_decode_agent_is_refused_to_another(
    pair: tuple[WorkerProc, WorkerProc], smol_tokenizer: Any
) -> None:
    """Two decode agents of this process, both handshaken with the prefill worker: while the first one's prefill
    is live there (its writes land late), the same request id from the second is refused 409 request_id_in_use,
    an OpenAI-shaped error, with nothing registered for it (no write reaches its pool); the first exchange ends
    done, its KV in its own pool."""
    p, _ = pair
    with (
        _own_decode_agent(p, "first") as (first, first_pool, layout),
        _own_decode_agent(p, "second") as (
            second,
            second_pool,
            _,
        ),
    ):
        ids = _prompt(smol_tokenizer, 60, "in-use")
        pages = list(range(-(-len(ids) // layout["page_size"])))
        body = prefill_request(first, ids, pages, 30)
        other = {**prefill_request(second, ids, pages, 30), "req_id": body["req_id"]}
        with httpx.stream("POST", f"{p.url}/internal/prefill", json=body, timeout=httpx.Timeout(10, read=20)) as live:
            assert live.status_code == 200
            refused = httpx.post(f"{p.url}/internal/prefill", json=other, timeout=10)
            assert refused.status_code == 409, refused.text
            err = assert_openai_error(refused.json())
            assert err["code"] == "request_id_in_use" and body["req_id"] in err["message"], err
            lines = [json.loads(line) for line in live.iter_lines() if line]
        assert lines[-1].get("done") is True, lines
        assert first_pool.kv[: len(pages)].abs().sum() > 0
        assert second_pool.kv.abs().sum() == 0  # nothing was written for the refused copy
    wait_pages_back(p)


def test_a_prefill_refused_after_its_504_frees_the_pages_at_once(
    pair: tuple[WorkerProc, WorkerProc], smol_tokenizer: Any
) -> None:
    """The prefill worker's engine frozen (SIGSTOP) with a cancel of a request queued for it, then the request:
    its control plane answers the prefill 504 after 30 s, so the decode worker fails the request and holds its
    pages (the engine may still take it). Thawed, the engine refuses it (cancelled) and, told of the 504, sends
    the "closed" notice: the pages come back at once, not after the 300 s last-resort deadline."""
    p, d = pair
    generate(d, _prompt(smol_tokenizer, 20, "warm"), p, max_tokens=2)  # the handshake needs a running engine
    body = generate_body(_prompt(smol_tokenizer, 60, "late"), p.url, max_tokens=8)
    cancel = {"dst_agent": "decode-agent", "dst_instance_id": "instance", "req_ids": [body["req_id"]]}
    engine = engine_pid(p.proc.pid)
    out: dict[str, Any] = {}
    os.kill(engine, signal.SIGSTOP)
    try:
        cancelling = threading.Thread(
            target=lambda: httpx.post(f"{p.url}/internal/cancel", json=cancel, timeout=60), daemon=True
        )
        queued = engine_pipe_queued(engine)
        cancelling.start()
        # Its command goes down the engine's pipe ahead of the request's.
        wait_until(lambda: engine_pipe_queued(engine) > queued, 30, "the cancel queued for the stopped engine")
        requesting = threading.Thread(target=lambda: out.update(events=_stream_generate(d, body, timeout=90)))
        requesting.start()
        requesting.join(60)
        assert not requesting.is_alive(), "the decode worker kept waiting on a prefill answered 504"
        assert out["events"][-1]["finish_reason"] == "error", out["events"][-1]
        assert d.load()["free_pages"] < d.load()["total_pages"]  # held: a late write was still possible
    finally:
        os.kill(engine, signal.SIGCONT)
    cancelling.join(60)
    wait_pages_back(p, d, timeout=30)
    assert _metric(d, "kvferry_kv_forced_releases_total") == 0
