"""A ~7 MiB prompt against a real `kvferry router` process: how fast it is refused, what it does to other
clients' latency meanwhile, and the router's memory afterwards.

    python bench/big_prompt.py [--requests 20] [--router-repo PATH] [--out bench/out/big_prompt.json]

Starts a zero-cost decode worker (bench/fake_worker.py) and `python -m router` in front of it (the router from
``--router-repo``, default this checkout: pointing it at another checkout measures that one in the same way).
Measures, in one run: a small chat's latency alone (median of sequential calls), then ``--requests`` big
prompts sent in turn to chat, /tokenize, /v1/completions and /v1/responses (the time to each answer) while
another client keeps sending the small chat (its median meanwhile, and the ratio to alone), and the router's
RSS idle before and after (after waiting for it to settle).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.net import free_port  # noqa: E402

SMALL = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 16}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def big_bodies(mib: int) -> list[tuple[str, bytes]]:
    text = ("The quick brown fox jumps over the lazy dog. " * (mib * 1024 * 1024 // 45 + 1))[: mib * 1024 * 1024]
    return [
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": text}]}).encode()),
        ("/tokenize", json.dumps({"prompt": text}).encode()),
        ("/v1/completions", json.dumps({"prompt": text, "max_tokens": 4}).encode()),
        ("/v1/responses", json.dumps({"input": text}).encode()),
    ]


def small_chat_s(client: httpx.Client, url: str) -> float:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=SMALL)
    assert r.status_code == 200, r.text[:300]
    return time.perf_counter() - t0


def wait_until(check, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--mib", type=int, default=7)
    ap.add_argument("--alone", type=int, default=40, help="small chats measured alone")
    ap.add_argument("--router-repo", default=str(REPO))
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "big_prompt.json"))
    args = ap.parse_args()
    router_repo = Path(args.router_repo).resolve()
    wport, rport = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(router_repo)}
    fake = [sys.executable, str(REPO / "bench" / "fake_worker.py"), "--port", str(wport), "--step-s", "0.002"]
    worker = subprocess.Popen(fake, cwd=REPO)
    cmd = [sys.executable, "-m", "router", "--port", str(rport), "--host", "127.0.0.1", "--discovery", "static"]
    cmd += ["--decode-urls", f"http://127.0.0.1:{wport}"]
    router = subprocess.Popen(cmd, cwd=router_repo, env=env)
    url = f"http://127.0.0.1:{rport}"
    try:
        with httpx.Client(timeout=120) as client:

            def ready() -> bool:
                try:
                    return client.get(url + "/ready").status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until(ready, 120, "router not ready")
            for _ in range(5):  # warm: the chat template's first render imports its renderer
                small_chat_s(client, url)
            rss_idle = rss_mb(router.pid)
            alone = [small_chat_s(client, url) for _ in range(args.alone)]

            stop = threading.Event()
            during: list[float] = []

            def other_client() -> None:
                with httpx.Client(timeout=120) as c:
                    while not stop.is_set():
                        during.append(small_chat_s(c, url))

            bodies = big_bodies(args.mib)
            refused: dict[str, list[float]] = {path: [] for path, _ in bodies}
            statuses: set[int] = set()
            rss_peak = rss_idle
            thread = threading.Thread(target=other_client, daemon=True)
            thread.start()
            try:
                for i in range(args.requests):
                    path, body = bodies[i % len(bodies)]
                    t0 = time.perf_counter()
                    r = client.post(url + path, content=body, headers={"content-type": "application/json"})
                    refused[path].append(time.perf_counter() - t0)
                    statuses.add(r.status_code)
                    rss_peak = max(rss_peak, rss_mb(router.pid))
            finally:
                stop.set()
                thread.join(120)
            time.sleep(2.0)  # let freed memory go back (what an idle router would show a minute later)
            rss_after = rss_mb(router.pid)
    finally:
        router.terminate()
        worker.terminate()
        router.wait(30)
        worker.wait(30)
    every = [t for ts in refused.values() for t in ts]
    result = {
        "router_repo": str(router_repo),
        "prompt_mib": args.mib,
        "requests": args.requests,
        "statuses": sorted(statuses),
        "answer_s": {path: round(statistics.median(ts), 4) for path, ts in refused.items() if ts},
        "answer_s_max": round(max(every), 4),
        "small_chat_alone_p50_s": round(statistics.median(alone), 4),
        "small_chat_during_p50_s": round(statistics.median(during), 4) if during else None,
        "small_chat_during_max_s": round(max(during), 4) if during else None,
        "small_chats_during": len(during),
        "latency_ratio_p50": round(statistics.median(during) / statistics.median(alone), 3) if during else None,
        "rss_idle_mb": round(rss_idle, 1),
        "rss_peak_mb": round(rss_peak, 1),
        "rss_after_mb": round(rss_after, 1),
        "rss_growth_mb": round(rss_after - rss_idle, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
