"""Real worker processes for tests: `kvferry prefill|decode` on free ports, launched and awaited by the
same code as `kvferry up` (common/devcluster/); each worker's output goes to a log file whose tail
is shown when it fails to start."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from common.devcluster.process import ManagedProcess, worker_process
from common.devcluster.process import wait_ready as wait_parts_ready
from common.net import free_port
from tests.helpers import wait_until

LOG_DIR = Path(tempfile.mkdtemp(prefix="kvferry-test-workers-"))


@dataclass
class WorkerProc:
    role: str
    port: int
    part: ManagedProcess
    pod: str

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.part.proc is not None
        return self.part.proc

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
                self.part.kill_group()

    def kill9(self) -> None:
        self.part.kill_group()  # the control plane, its engine child and any tensor-parallel ranks


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
        "KVFERRY_POD_NAME": pod,
        "KVFERRY_PREFILL_PEERS": "http://127.0.0.1",  # any test worker on this host (they take free ports)
        **(env or {}),
    }
    part = worker_process(role, port, redis_url, full_env, LOG_DIR / f"{pod}-{uuid.uuid4().hex[:6]}.log", name=pod)
    part.start()
    return WorkerProc(role, port, part, pod)


def wait_ready(*workers: WorkerProc, timeout: float = 180) -> None:
    wait_parts_ready([w.part for w in workers], timeout)


def generate_body(ids: list[int], prefill_url: str | None = None, max_tokens: int = 24, **extra: object) -> dict:
    """A decode worker's /internal/generate body under a fresh request id (exact lengths: ignore_eos)."""
    return {
        "req_id": uuid.uuid4().hex,
        "token_ids": ids,
        "prefill_url": prefill_url,
        "sampling": {"max_tokens": max_tokens, "ignore_eos": True},
        **extra,
    }


def generate(
    decode: WorkerProc, ids: list[int], prefill: WorkerProc | None, max_tokens: int = 24, timeout: float = 120
) -> tuple[list[int], list[dict]]:
    body = generate_body(ids, prefill.url if prefill else None, max_tokens)
    tokens, events = [], []
    with httpx.stream("POST", f"{decode.url}/internal/generate", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                ev = json.loads(line)
                events.append(ev)
                tokens += ev.get("token_ids", [])
    return tokens, events


def give_up_during_remote_prefill(decode: WorkerProc, prefill: WorkerProc, ids: list[int]) -> None:
    """Opens a generate stream on `decode` with `prefill` as its peer and closes it once the peer is prefilling
    it (the caller gone mid-prefill): both sides must then give the request up and free its pages."""
    body = generate_body(ids, prefill.url, max_tokens=64)
    with httpx.stream("POST", f"{decode.url}/internal/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        wait_until(lambda: prefill.load()["running_requests"], 10, "the peer to prefill it", interval=0.02)
        assert prefill.load()["running_requests"] == 1  # the prefill is under way


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


def start_router_thread(app, timeout: float = 20.0):
    """Serves a router app in this process (router/server_thread.py) and returns it once its pool sees every
    worker up."""
    from router.server_thread import ServerThread

    s = ServerThread(app).start()

    def workers_up() -> bool:
        return all(w["up"] for w in httpx.get(f"{s.url}/router/workers").json()["workers"])

    wait_until(workers_up, timeout, "the router to see every worker up")
    return s


@dataclass
class RouterProc:
    proc: subprocess.Popen[bytes]
    url: str

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def start_router_process(*args: str, timeout: float = 120.0) -> RouterProc:
    """`python -m router` (static discovery) as its own process, on a free port, once it answers /health: where
    what the router process itself holds (its memory) is measured."""
    port = free_port()
    log = open(LOG_DIR / f"router-{port}.log", "wb")
    argv = ["python3", "-m", "router", "--host", "127.0.0.1", "--port", str(port), "--discovery", "static", *args]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(argv, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=log, stderr=log)
    log.close()
    router = RouterProc(proc, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(router.url + "/health", timeout=5).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            router.stop()
            raise AssertionError(f"router did not start: {(LOG_DIR / f'router-{port}.log').read_text()[-2000:]}")
        time.sleep(0.1)


def prefill_layout(prefill_url: str) -> dict[str, Any]:
    """The prefill worker's KV layout, read off the mismatch it reports for a deliberately wrong one."""
    layout = {
        "model_id": "?",
        "dtype": "?",
        "page_size": 0,
        "num_layers": 0,
        "num_kv_heads": 0,
        "head_dim": 0,
        "layout_version": 0,
    }
    hs = {
        "agent_name": "probe",
        "instance_id": "probe",
        "agent_metadata_b64": "",
        "pool_info_b64": "",
        "layout": layout,
    }
    r = httpx.post(f"{prefill_url}/internal/handshake", json=hs, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "layout_mismatch", r.text
    for field, local in re.findall(r"(\w+): local=('[^']*'|-?\d+)", r.json()["error"]["message"]):
        layout[field] = ast.literal_eval(local)
    return layout


def prefill_request(agent: Any, token_ids: list[int], pages: list[Any], deadline_s: float) -> dict[str, Any]:
    """A body for a prefill worker's /internal/prefill whose KV goes to `agent` (a test's own NIXL agent)."""
    return {
        "req_id": uuid.uuid4().hex,
        "token_ids": token_ids,
        "sampling": {},
        "dst_agent": agent.name,
        "dst_instance_id": agent.instance_id,
        "dst_pages": pages,
        "deadline_s": deadline_s,
    }
