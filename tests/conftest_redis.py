"""A real redis-server for tests (no mocks: the Lua scripts and connection-failure paths are what we want to
exercise), started by the same code as `kvferry up` (common/devcluster/redis_server.py).

Import ``redis_server`` into a test module or conftest.py to use the session-wide server; call
``start_redis(port)`` directly for a private server a test may kill and restart on the same port.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.devcluster.process import ManagedProcess
from common.devcluster.redis_server import start_redis_server
from common.net import free_port  # re-exported: tests import it from here

__all__ = ["free_port", "redis_server", "start_redis", "stop_redis"]

LOG_DIR = Path(tempfile.mkdtemp(prefix="kvferry-test-redis-"))


def start_redis(port: int, timeout_s: float = 10.0) -> ManagedProcess:
    """An in-memory redis-server on 127.0.0.1:``port`` that answers PING (nothing survives a restart, which
    the resync tests rely on)."""
    return start_redis_server(port, LOG_DIR / f"redis-{port}.log", timeout_s=timeout_s)


def stop_redis(server: ManagedProcess, timeout_s: float = 5.0) -> None:
    """Stop a server from ``start_redis`` (killed if it does not exit in time) and reap it."""
    server.stop(timeout_s)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a redis-server shared by the whole test session."""
    server = start_redis(free_port())
    try:
        yield server.url or ""
    finally:
        stop_redis(server)
