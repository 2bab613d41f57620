"""Graceful drain on SIGTERM: readiness drops at once, in-flight streams finish, new work is refused,
the pod's prefix entries leave Redis, then the process exits."""

from __future__ import annotations

import json
import signal
import threading
import uuid

import httpx
import redis

from tests.helpers import wait_until
from tests.workers import start_worker, wait_ready


def test_sigterm_drains_in_flight_stream(redis_server, smol_tokenizer):
    d = start_worker("decode", redis_server, env={"KVFERRY_DRAIN_SECONDS": "60"})
    try:
        wait_ready(d)
        ids = smol_tokenizer.encode("Tell me a long story about the sea and its sailors.")
        body = {"req_id": uuid.uuid4().hex, "token_ids": ids, "sampling": {"max_tokens": 48, "ignore_eos": True}}
        got: dict = {"tokens": []}
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{d.url}/internal/generate", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        ev = json.loads(line)
                        got["tokens"] += ev.get("token_ids", [])
                        got["last"] = ev
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        d.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{d.url}/ready", timeout=5).status_code != 200, 5, "readiness to drop on SIGTERM")
        refused = httpx.post(f"{d.url}/internal/generate", json={**body, "req_id": "late"}, timeout=10)
        assert refused.status_code == 503
        t.join(120)
        assert got["last"]["finish_reason"] == "length" and len(got["tokens"]) == 48
        assert d.proc.wait(30) == 0
        # The pod deregistered from the prefix index on its way out.
        keys = redis.Redis.from_url(redis_server).keys(f"kvf:*{d.pod}*")
        assert keys == []
    finally:
        d.stop()
