"""A real redis-server for tests, started from the binary on PATH (no mocks: the Lua scripts and
connection-failure paths are what we want to exercise).

Import ``redis_server`` into a test module or conftest.py to use the session-wide server; call
``start_redis(port)`` directly for a private server a test may kill and restart on the same port.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis

from common.net import free_port  # re-exported: tests import it from here

__all__ = ["free_port", "redis_server", "start_redis", "stop_redis"]

REDIS_BIN = shutil.which("redis-server") or "/usr/bin/redis-server"


def start_redis(port: int, timeout_s: float = 10.0) -> subprocess.Popen[bytes]:
    """Start an in-memory redis-server on 127.0.0.1:``port`` and return once it answers PING."""
    proc = subprocess.Popen(
        [
            REDIS_BIN,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            # Pure in-memory: no RDB/AOF files in the working directory, nothing survives a restart
            # (which is what the resync tests rely on).
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2, socket_timeout=0.5)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode} (port {port} taken?)")
            try:
                if client.ping():
                    return proc
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                stop_redis(proc)
                raise RuntimeError(f"redis-server on port {port} did not answer PING in {timeout_s}s")
            time.sleep(0.02)
    finally:
        client.close()


def stop_redis(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """Terminate a server from ``start_redis`` (kill if it does not exit) and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a redis-server shared by the whole test session."""
    if not shutil.which(REDIS_BIN):
        pytest.skip("redis-server binary not found")
    port = free_port()
    proc = start_redis(port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_redis(proc)
