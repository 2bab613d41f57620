"""What many tests do the same way: wait on an observable state with a deadline, read a worker's load, find a
worker's engine process, check an OpenAI-shaped error, run a local cluster for a module."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import httpx

from common.devcluster.cluster import LocalCluster, start_local_cluster


class HasUrl(Protocol):
    @property
    def url(self) -> str: ...


def load(url: str) -> dict[str, Any]:
    """A worker's `/load` snapshot."""
    return httpx.get(f"{url}/load", timeout=5).json()


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Polls ``pred`` until it returns something true (returned) or ``timeout`` passes (AssertionError naming
    ``what``). A worker that does not answer yet (an HTTP error) counts as not yet."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = pred()
        except httpx.HTTPError as e:
            last = e
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what}: {last!r}") from None
            time.sleep(interval)
            continue
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def pages_back(ld: dict[str, Any]) -> bool:
    """A load snapshot with every KV page free and no request running or waiting."""
    return ld["free_pages"] == ld["total_pages"] > 0 and ld["running_requests"] == 0 and ld["waiting_requests"] == 0


def wait_pages_back(*workers: str | HasUrl, timeout: float = 15.0) -> float:
    """Every worker (a URL, or anything with a ``url``) has all its KV pages free and nothing running or waiting;
    returns how long that took."""
    urls = [w if isinstance(w, str) else w.url for w in workers]
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        loads = {u: load(u) for u in urls}
        if all(pages_back(ld) for ld in loads.values()):
            return time.monotonic() - t0
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pages not returned within {timeout:g}s: {loads}")
        time.sleep(0.05)


def engine_pids(worker_pid: int) -> list[int]:
    """The worker's engine processes: its multiprocessing children (not the resource tracker); empty while none
    runs (an engine restarting)."""
    kids: list[int] = []
    for task in Path(f"/proc/{worker_pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [k for k in kids if b"spawn_main" in _cmdline(k)]


def engine_pid(worker_pid: int) -> int:
    """The worker's one running engine process."""
    (pid,) = engine_pids(worker_pid)
    return pid


def engine_pipe_queued(pid: int) -> int:
    """Bytes sent to process ``pid`` over its Unix sockets and not read yet (``ss``'s Recv-Q): for a stopped
    engine, the commands its control plane queued on the pipe meanwhile."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    queued = 0
    for line in subprocess.run(["ss", "-xn"], capture_output=True, text=True, check=True).stdout.splitlines()[1:]:
        cols = line.split()  # Netid State Recv-Q Send-Q Local-Address Port Peer-Address Port
        if len(cols) >= 6 and cols[5] in inodes:
            queued += int(cols[2])
    return queued


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # exited meanwhile
        return b""


def assert_openai_error(body: Any) -> dict[str, Any]:
    """``body`` is an OpenAI-shaped error; returns its ``error`` object."""
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], body
    assert isinstance(err.get("type"), str) and err["type"], body
    assert set(err) >= {"message", "type", "param", "code"}, body
    return err


# The clusters of running_cluster now up: a failing test's report carries their logs' ends (conftest.py), since a
# cluster that made its own log directory removes it when it stops.
LIVE_CLUSTERS: list[LocalCluster] = []
LOG_TAIL_LINES = 40


def cluster_log_tails(c: LocalCluster) -> str:
    """The last LOG_TAIL_LINES lines of each part's log (router, workers, Redis)."""
    return "\n".join(f"--- {p.log_path.name}\n{p.log_tail(LOG_TAIL_LINES)}" for p in c.parts)


@contextmanager
def running_cluster(
    prefill: int, decode: int, env: dict[str, str], wait_up: bool = True, **kw: Any
) -> Iterator[LocalCluster]:
    """A local cluster (common/devcluster/cluster.py) for a module's tests, stopped however they end; ``wait_up``:
    once the router sees every worker up."""
    c = start_local_cluster(
        prefill=prefill, decode=decode, env=env, ready_timeout_s=kw.pop("ready_timeout_s", 300), **kw
    )
    LIVE_CLUSTERS.append(c)
    try:
        if wait_up:
            wait_until(
                lambda: all(w["up"] for w in httpx.get(f"{c.router_url}/router/workers", timeout=5).json()["workers"]),
                60,
                "the router sees every worker up",
            )
        yield c
    finally:
        LIVE_CLUSTERS.remove(c)
        c.stop()
