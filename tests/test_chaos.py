"""Workers die under load and nobody notices: `kvferry up` (2 prefill + 2 decode workers, its router, Redis)
as a command, its workers killed with -9 while clients stream greedy requests.

- a killed worker is restarted by `kvferry up` (common/devcluster/supervisor.py) and taken back into routing,
  and requests are answered throughout;
- chaos: continuous streaming load with a worker (decode or prefill, in turn) killed every few seconds, while
  the one before it is back: every request completes under HTTP 200 with the text of a fault-free run, none
  hangs, and every KV page comes back. Streams on a killed decode worker migrate (router/upstream/migration.py);
  requests in a killed prefill worker are retried before their first token.

Size: at least KVFERRY_CHAOS_REQUESTS at KVFERRY_CHAOS_CONCURRENCY, and on until a worker of each role was
killed; a kill every KVFERRY_CHAOS_KILL_EVERY_S (small CI defaults below). By hand, e.g. ``KVFERRY_CHAOS_REQUESTS=1000 KVFERRY_CHAOS_CONCURRENCY=32 python -m pytest
tests/test_chaos.py -s``; the figures (requests, kills, migrations, latency percentiles) are printed and, with
KVFERRY_CHAOS_OUT=<file>, saved as JSON.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.net import free_port
from tests.helpers import load, wait_pages_back, wait_until
from tests.test_reliability import ENV, MODEL, long_prompt, sse_events

pytestmark = pytest.mark.timeout(600)

REQUESTS = int(os.environ.get("KVFERRY_CHAOS_REQUESTS", "40"))
CONCURRENCY = int(os.environ.get("KVFERRY_CHAOS_CONCURRENCY", "6"))
KILL_EVERY_S = float(os.environ.get("KVFERRY_CHAOS_KILL_EVERY_S", "4"))
MAX_TOKENS = 24


@dataclass
class UpCluster:
    """A running `kvferry up` and what its router says about its workers."""

    proc: subprocess.Popen[str]
    router_url: str
    log_dir: Path
    output: list[str] = field(default_factory=list)

    def workers(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.router_url}/router/workers", timeout=5).json()["workers"]

    def urls(self, role: str | None = None) -> list[str]:
        return [w["url"] for w in self.workers() if role is None or w["role"] == role]

    def all_up(self) -> bool:
        ws = self.workers()
        return len(ws) == 4 and all(w["up"] for w in ws)

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.router_url}/router/workers", timeout=5).json()


def _pid_serving(port: int) -> int:
    """The `kvferry prefill|decode` process started with ``--port <port>`` (its process group leader)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"common.cli" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
            return int(entry.name)
    raise AssertionError(f"no kvferry process serves port {port}")


def kill9(url: str) -> None:
    """kill -9 of a worker: its control plane and engine (one process group per part)."""
    os.killpg(_pid_serving(int(url.rsplit(":", 1)[1])), signal.SIGKILL)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    port = free_port()
    log_dir = tmp_path_factory.mktemp("kvferry-up")
    argv = [sys.executable, "-m", "common.cli", "up", "--prefill", "2", "--decode", "2", "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, "--log-dir", str(log_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, **ENV),
        text=True,
        start_new_session=True,
    )
    c = UpCluster(proc, f"http://127.0.0.1:{port}", log_dir)
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: c.output.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until(lambda: "kvferry is up" in "".join(c.output), 300, "kvferry up", interval=0.2)
        wait_until(c.all_up, 60, "the router sees all four workers up")
        yield c
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(5)
        print("".join(c.output)[-3000:])


def stream(c: UpCluster, prompt: str, timeout: float = 120.0) -> dict[str, Any]:
    """One greedy streaming completion: its text, finish reason, error event and latency."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.monotonic()
    out: dict[str, Any] = {"text": "", "finish": None, "error": None, "status": None, "done": False}
    try:
        with httpx.stream("POST", f"{c.router_url}/v1/completions", json=body, timeout=timeout) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                r.read()
                out["error"] = r.text
                out["retry_after"] = r.headers.get("retry-after")
            else:
                for ev in sse_events(r):
                    if ev == "[DONE]":
                        out["done"] = True
                    elif "error" in ev:
                        out["error"] = ev["error"]
                    elif ev["choices"]:
                        out["text"] += ev["choices"][0]["text"]
                        out["finish"] = ev["choices"][0]["finish_reason"] or out["finish"]
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    out["seconds"] = time.monotonic() - t0
    return out


MAX_429_RETRIES = 5


def stream_retrying_429(c: UpCluster, prompt: str) -> dict[str, Any]:
    """`stream`, retried after a 429's Retry-After as OpenAI's clients do. With a worker down the fleet may be
    predicted past the interactive TTFT target and shed (docs/reliability.md: "nothing, or a 429"); a shed
    request must be answered, with the same text, once retried. The 429s are counted in ``shed``."""
    shed, t0 = 0, time.monotonic()
    while True:
        out = stream(c, prompt)
        if out["status"] != 429 or shed >= MAX_429_RETRIES:
            out.update(shed=shed, seconds=time.monotonic() - t0)
            return out
        shed += 1
        time.sleep(float(out.get("retry_after") or 1))


def _prompts() -> list[str]:
    # Short prompts are prefilled on their decode worker, long ones on a prefill worker (disaggregated).
    short = [f"Tell me a story about {x}." for x in ("a lighthouse", "a glacier", "a harbor", "a small robot")]
    return short + [long_prompt(300) for _ in range(4)]


def test_killed_worker_is_restarted_and_requests_keep_being_answered(up: UpCluster) -> None:
    c = up
    victim = c.urls("decode")[0]
    kill9(victim)
    # Requests go on meanwhile, on the other decode worker.
    for _ in range(3):
        r = stream(c, "The capital of France is")
        assert r["status"] == 200 and r["done"] and r["error"] is None and r["finish"] == "length", r
    wait_until(lambda: re.search(r"decode-\d restarted", "".join(c.output)), 30, "kvferry up restarting it")
    wait_until(c.all_up, 90, "the restarted worker back in routing", interval=0.2)
    assert c.proc.poll() is None, "kvferry up exited"
    assert "exited (code" in "".join(c.output)
    wait_pages_back(*c.urls())


def test_chaos_under_load(up: UpCluster) -> None:
    c = up
    prompts = _prompts()
    reference = {p: stream(c, p) for p in prompts}  # fault-free run
    assert all(r["status"] == 200 and r["finish"] == "length" for r in reference.values()), reference
    before = c.stats()["migrations"]
    stop = threading.Event()
    kills: list[tuple[str, str]] = []  # (role, url)

    def killer() -> None:
        rng = random.Random(0)
        roles = ["decode", "prefill"]
        while not stop.wait(KILL_EVERY_S):
            try:
                if not c.all_up():
                    continue  # the last one is not back yet: never more than one worker down
                role = roles[len(kills) % 2]
                victim = rng.choice(c.urls(role))
                kill9(victim)
                kills.append((role, victim))
            except (httpx.HTTPError, AssertionError):
                continue

    rng = random.Random(1)
    results: list[tuple[str, dict[str, Any]]] = []
    sent = 0
    lock = threading.Lock()

    def client() -> None:
        # At least REQUESTS, and on until a worker of each role was killed (however fast this machine is).
        nonlocal sent
        while True:
            with lock:
                roles = {role for role, _ in kills}
                if sent >= REQUESTS and (roles == {"prefill", "decode"} or sent >= 10 * REQUESTS):
                    return
                sent += 1
                prompt = rng.choice(prompts)
            out = stream_retrying_429(c, prompt)
            with lock:
                results.append((prompt, out))

    t = threading.Thread(target=killer, daemon=True)
    t0 = time.monotonic()
    t.start()
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            for f in [pool.submit(client) for _ in range(CONCURRENCY)]:
                f.result()
    finally:
        stop.set()
        t.join(30)
    wall = time.monotonic() - t0
    # The router's view lags a kill by up to a poll, so each worker must also answer itself (a refused connection
    # counts as not yet): once failed here with the last victim still marked up.
    wait_until(lambda: c.all_up() and all(load(u) for u in c.urls()), 120, "every killed worker back", interval=0.2)
    wait_pages_back(*c.urls(), timeout=30)
    stats = c.stats()
    after = stats["migrations"]
    latencies = sorted(r["seconds"] for _, r in results)
    failed = [(p[:40], r) for p, r in results if r["status"] != 200 or r["error"] or not r["done"]]
    wrong = [(p[:40], r["text"], reference[p]["text"]) for p, r in results if r["text"] != reference[p]["text"]]
    figures = {
        "requests": len(results),
        "concurrency": CONCURRENCY,
        "kills": len(kills),
        "killed_roles": {role: sum(r == role for r, _ in kills) for role in ("prefill", "decode")},
        "migrations": {k: after[k] - before[k] for k in after},
        "failed": len(failed),
        "shed_then_retried": sum(r.get("shed", 0) for _, r in results),
        "wrong_text": len(wrong),
        "wall_s": round(wall, 1),
        "latency_p50_s": round(latencies[len(latencies) // 2], 2),
        "latency_p99_s": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 2),
        "latency_max_s": round(latencies[-1], 2),
    }
    print("\nchaos:", json.dumps(figures))
    if os.environ.get("KVFERRY_CHAOS_OUT"):
        Path(os.environ["KVFERRY_CHAOS_OUT"]).write_text(json.dumps(figures, indent=2) + "\n")
    assert not failed, failed[:3]
    assert not wrong, wrong[:3]
    assert {role for role, _ in kills} == {"prefill", "decode"}, kills
