"""A throwaway redis-server for the prefix index: in memory only, on 127.0.0.1, nothing saved to disk (a
restart comes back empty, which is what the index's resync paths are tested against)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from common.devcluster.process import ClusterError, ManagedProcess
from common.settings_registry import REDIS_PASSWORD

__all__ = ["INSTALL_HINT", "redis_server", "start_redis_server", "wait_redis"]

INSTALL_HINT = (
    "redis-server is not installed (kvferry up runs one for the prefix index).\n"
    "  Debian/Ubuntu: sudo apt-get install -y redis-server\n"
    "  macOS:         brew install redis\n"
    "or point at a Redis you already run: kvferry up --redis-url redis://HOST:6379/0"
)


def redis_server(port: int, log_path: Path, env: dict[str, str] | None = None) -> ManagedProcess:
    """redis-server on 127.0.0.1:`port` (not started yet); ClusterError with install hints if it is missing.
    With KVFERRY_REDIS_PASSWORD in `env` it requires that password (``requirepass`` in a config file beside
    the log, readable by this user only: never in the command line, which `ps` shows everyone)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ClusterError(INSTALL_HINT)
    env = dict(os.environ) if env is None else env
    argv = [binary]
    password = REDIS_PASSWORD.read(env)
    if password:
        conf = log_path.with_suffix(".conf")
        conf.touch(mode=0o600)
        conf.write_text(f'requirepass "{_quoted(password)}"\n')
        argv.append(str(conf))
    argv += ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return ManagedProcess("redis", argv, env, log_path, url=f"redis://127.0.0.1:{port}/0")


def _quoted(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def wait_redis(part: ManagedProcess, timeout_s: float = 10.0) -> None:
    """Returns once `part` answers PING; ClusterError (with its log tail) if it exits or stays silent."""
    import redis

    assert part.url is not None
    password = REDIS_PASSWORD.read(part.env)
    r = redis.Redis.from_url(part.url, password=password, socket_connect_timeout=0.2, socket_timeout=0.5)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if not part.alive():
                raise ClusterError(f"redis-server exited:\n{part.log_tail()}")
            try:
                if r.ping():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"redis-server did not answer within {timeout_s:g}s:\n{part.log_tail()}")
            time.sleep(0.05)
    finally:
        r.close()


def start_redis_server(
    port: int, log_path: Path, env: dict[str, str] | None = None, timeout_s: float = 10.0
) -> ManagedProcess:
    """A started redis-server that answers PING (stopped again if it does not)."""
    part = redis_server(port, log_path, env)
    part.start()
    try:
        wait_redis(part, timeout_s)
    except BaseException:
        part.kill_group()
        raise
    return part
