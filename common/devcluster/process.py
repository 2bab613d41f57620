"""One part of a local cluster as a supervised subprocess, and the wait for parts to come up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["ClusterError", "ManagedProcess", "kvferry_argv", "wait_ready", "worker_process"]


class ClusterError(RuntimeError):
    pass


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    url: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    cwd: Path | None = None  # `python -m` puts the cwd first on sys.path: callers in bench/ pass the repo root

    def start(self) -> None:
        log = open(self.log_path, "ab")
        try:
            # Own session: Ctrl-C in the terminal reaches only `kvferry up`, which stops the parts in
            # order; and a part's own children (a worker's engine process) can be killed as a group.
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then the whole process group killed if it has not exited within `grace_s`."""
        self.signal(signal.SIGTERM)
        self.finish(time.monotonic() + grace_s)

    def finish(self, deadline: float, at_least_s: float = 0.0) -> None:
        """Waits for the process until `deadline` (monotonic; several parts stopping together share one), or
        `at_least_s` past it, then kills its whole process group: the engine process and anything else it started."""
        if self.proc is None:
            return
        try:
            self.proc.wait(max(at_least_s, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        self.kill_group()

    def kill_group(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this process leads (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def kvferry_argv(*args: str) -> list[str]:
    """`python -m common.cli ...`: the `kvferry` console script without depending on PATH."""
    return [sys.executable, "-m", "common.cli", *args]


def worker_process(
    role: str, port: int, redis_url: str, env: dict[str, str], log_path: Path, name: str = "", args: Sequence[str] = ()
) -> ManagedProcess:
    """A `kvferry prefill|decode` worker on 127.0.0.1:`port` (not started yet)."""
    return ManagedProcess(
        name or role,
        kvferry_argv(role, "--host", "127.0.0.1", "--port", str(port), "--redis-url", redis_url) + list(args),
        env,
        log_path,
        url=f"http://127.0.0.1:{port}",
    )


def wait_ready(
    parts: Sequence[ManagedProcess], timeout_s: float, progress: Callable[[str], None] | None = None
) -> None:
    """Returns once every part answers 200 on /ready; raises ClusterError (with its log tail) when one
    exits or the time runs out."""
    progress = progress or (lambda _msg: None)
    pending = list(parts)
    start = time.monotonic()
    last_note = 0.0
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for p in list(pending):
                if not p.alive():
                    raise ClusterError(f"{p.name} exited during startup (log {p.log_path}):\n{p.log_tail()}")
                try:
                    if client.get(f"{p.url}/ready").status_code == 200:
                        pending.remove(p)
                        progress(f"  {p.name} ready at {p.url} ({time.monotonic() - start:.0f} s)")
                except httpx.HTTPError:
                    pass
            elapsed = time.monotonic() - start
            if pending and elapsed > timeout_s:
                names = ", ".join(p.name for p in pending)
                raise ClusterError(f"not ready after {timeout_s:g}s: {names}\n{pending[0].log_tail()}")
            if pending and elapsed - last_note >= 5.0:
                last_note = elapsed
                progress(f"  waiting for {', '.join(p.name for p in pending)} ({elapsed:.0f} s)")
            if pending:
                time.sleep(0.2)
