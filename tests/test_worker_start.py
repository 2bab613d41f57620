"""A worker whose engine cannot start exits non-zero with the cause in its log, instead of hanging unready; one
whose engine dies later starts it again by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.helpers import engine_pid, engine_pids, wait_until
from tests.workers import generate_body, start_worker, wait_ready


def test_engine_that_fails_to_start_makes_the_worker_exit(redis_server) -> None:
    w = start_worker("decode", redis_server, env={"KVFERRY_MODEL": "/nonexistent/model-dir"})
    try:
        try:
            code = w.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("the worker kept running with an engine that could not start") from None
        assert code == 3
        log = w.part.log_path.read_text()
        assert "engine process exited before it was ready" in log
        assert "/nonexistent/model-dir" in log  # the engine's own error names the cause
    finally:
        w.kill9()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


@pytest.mark.parametrize("role", ["decode", "prefill", "mixed"])
def test_killed_engine_is_restarted_by_its_worker(redis_server, role: str) -> None:
    """kill -9 of the engine process (what the OOM killer picks): the control plane says so in one log line,
    reports not ready and none of the dead engine's numbers while it starts a new engine, keeps /health at
    200 (a kubelet must not restart the pod for it), and serves again within 30 s, by itself."""
    w = start_worker(role, redis_server)
    try:
        wait_ready(w)
        before = w.load()
        assert before["ready"] and before["total_pages"] == 512
        engine = engine_pid(w.proc.pid)
        assert engine is not None
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: httpx.get(f"{w.url}/ready", timeout=2).status_code != 200, 5, "readiness to drop")
        during = w.load()
        assert not during["ready"]
        assert during["total_pages"] == 0 and during["free_pages"] == 0  # no pool without an engine
        health = httpx.get(f"{w.url}/health", timeout=2)
        assert health.status_code == 200 and health.json()["status"] in ("restarting", "ok"), health.text
        assert _metric(w.url, "kvferry_kv_pages_total") in (0.0, 512.0)  # zero until the new engine reports
        while httpx.get(f"{w.url}/ready", timeout=2).status_code != 200:
            assert w.proc.poll() is None, w.part.log_tail()
            assert time.monotonic() - killed < 30, "the engine was not back within 30 s:\n" + w.part.log_tail()
            time.sleep(0.1)
        assert engine_pids(w.proc.pid) not in ([], [engine])
        assert _metric(w.url, "kvferry_engine_restarts_total") == 1
        assert w.load()["total_pages"] == 512
        if role != "prefill":  # serves again (a prefill worker's serving is shown by the cluster tests)
            body = generate_body([1, 2, 3, 4, 5], max_tokens=4)
            r = httpx.post(f"{w.url}/internal/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            lines = [json.loads(x) for x in r.text.splitlines() if x]
            assert lines[-1]["finish_reason"] in ("length", "stop"), lines
        log = w.part.log_path.read_text()
        assert log.count("engine process died; restarting it") == 1, log
        assert "engine restarted" in log
    finally:
        w.kill9()


def test_engine_that_cannot_be_restarted_makes_the_worker_exit(redis_server) -> None:
    """With KVFERRY_ENGINE_RESTARTS=1, a restarted engine that dies before it is ready ends the worker with
    exit code 4 (its supervisor or kubelet starts it afresh) instead of an endless restart loop."""
    w = start_worker("decode", redis_server, env={"KVFERRY_ENGINE_RESTARTS": "1"})
    try:
        wait_ready(w)
        first = engine_pid(w.proc.pid)
        os.kill(first, signal.SIGKILL)
        (second,) = wait_until(
            lambda: [k for k in engine_pids(w.proc.pid) if k != first], 30, "the engine started again", interval=0.02
        )
        assert httpx.get(f"{w.url}/ready", timeout=2).status_code == 503  # still starting
        os.kill(second, signal.SIGKILL)
        try:
            code = w.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the worker kept running with an engine that could not restart") from None
        assert code == 4
        assert "engine could not be restarted; the worker exits" in w.part.log_path.read_text()
    finally:
        w.kill9()
