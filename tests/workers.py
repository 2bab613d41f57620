"""Real worker processes for tests: `kvferry prefill|decode` subprocesses on free ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import httpx

from tests.conftest_redis import free_port


@dataclass
class WorkerProc:
    role: str
    port: int
    proc: subprocess.Popen
    pod: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def load(self) -> dict:
        return httpx.get(f"{self.url}/load", timeout=5).json()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill9(self) -> None:
        # The engine child dies with its parent's pipe; kill the whole process group to be sure.
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def start_worker(
    role: str, redis_url: str, port: int | None = None, env: dict[str, str] | None = None, pod: str | None = None
) -> WorkerProc:
    port = port or free_port()
    pod = pod or f"test-{role}-{port}"
    full_env = {
        **os.environ,
        "KVFERRY_NUM_PAGES": "512",
        "KVFERRY_MAX_RUNNING": "32",
        "KVFERRY_MAX_PREFILL_TOKENS": "64",
        "KVFERRY_TORCH_THREADS": "1",
        "KVFERRY_LOG_LEVEL": "WARNING",
        **(env or {}),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "common.cli",
            role,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            "--pod-name",
            pod,
        ],
        env=full_env,
        start_new_session=True,
    )
    return WorkerProc(role, port, proc, pod)


def wait_ready(*workers: WorkerProc, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    for w in workers:
        while True:
            if w.proc.poll() is not None:
                raise RuntimeError(f"{w.role} worker exited with {w.proc.returncode}")
            try:
                if httpx.get(f"{w.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{w.role} worker on {w.port} not ready")
            time.sleep(0.2)


def generate(
    decode: WorkerProc, ids: list[int], prefill: WorkerProc | None, max_tokens: int = 24, timeout: float = 120
) -> tuple[list[int], list[dict]]:
    body = {
        "req_id": uuid.uuid4().hex,
        "token_ids": ids,
        "prefill_url": prefill.url if prefill else None,
        "sampling": {"max_tokens": max_tokens, "ignore_eos": True},
    }
    tokens, events = [], []
    with httpx.stream("POST", f"{decode.url}/internal/generate", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                ev = json.loads(line)
                events.append(ev)
                tokens += ev.get("token_ids", [])
    return tokens, events


def wait_pages_back(*workers: WorkerProc, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        loads = [w.load() for w in workers]
        if all(ld["free_pages"] == ld["total_pages"] and ld["running_requests"] == 0 for ld in loads):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pages not returned: {loads}")
        time.sleep(0.1)


def run_concurrently(fn, args_list):
    results: list = [None] * len(args_list)

    def one(i, args):
        results[i] = fn(*args)

    threads = [threading.Thread(target=one, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
