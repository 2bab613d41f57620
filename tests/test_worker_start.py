"""A worker whose engine cannot start exits non-zero with the cause in its log, instead of hanging unready."""

from __future__ import annotations

import subprocess

from tests.workers import start_worker


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
