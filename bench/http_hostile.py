"""Hostile HTTP clients against a real `kvferry router` process (raw sockets), with the HTTP limits as set.

    python bench/http_hostile.py [--out bench/out/http_hostile.json]

Starts `python -m router` (static discovery, no workers: every probe here is answered before routing) with the
KVFERRY_HTTP_* settings of this environment, then measures: a 128 MB header (time to the answer, bytes sent
before it, router memory, and a concurrent /health's latency against the same /health alone: the in-run
ratio), 1 MB of headers, 10,000 headers, 300 sockets holding a partial request line, a silent socket, and a
chunked body that never ends (time each is closed, what it was answered).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.net import free_port  # noqa: E402
from common.settings import HttpLimits  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def health_s(addr: tuple[str, int]) -> float:
    t0 = time.perf_counter()
    with socket.create_connection(addr, timeout=60) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        while s.recv(65536):
            pass
    return time.perf_counter() - t0


def status_of(raw: bytes) -> int | None:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else None


def until_closed(s: socket.socket, limit_s: float) -> tuple[bytes, float | None]:
    """What the server sends until it closes, and when (None: still open after ``limit_s``)."""
    data = b""
    t0 = time.monotonic()
    while True:
        left = limit_s - (time.monotonic() - t0)
        if left <= 0:
            return data, None
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return data, None
        except ConnectionResetError:
            return data, time.monotonic() - t0
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk


def one_request(addr: tuple[str, int], raw: bytes) -> int | None:
    with socket.create_connection(addr, timeout=60) as s:
        try:
            s.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _ = until_closed(s, 60)
    return status_of(data)


def big_header(addr: tuple[str, int], pid: int, size: int) -> dict:
    rss_before = rss_mb(pid)
    alone = [health_s(addr) for _ in range(20)]
    during: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            during.append(health_s(addr))
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.monotonic()
    sent = 0
    answer = b""
    with socket.create_connection(addr, timeout=60) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        piece = b"a" * (1 << 20)
        s.setblocking(False)
        while sent < size:
            try:
                sent += s.send(piece)
            except BlockingIOError:
                time.sleep(0.001)
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                answer += s.recv(65536)
                break
            except BlockingIOError:
                pass
            except ConnectionResetError:
                break
        s.setblocking(True)
        rest, _ = until_closed(s, 30)
        answer += rest
    answered_s = time.monotonic() - t0
    time.sleep(0.5)
    done.set()
    poller.join(60)
    return {
        "header_bytes_offered": size,
        "bytes_sent_before_the_answer": sent,
        "status": status_of(answer),
        "answered_s": round(answered_s, 3),
        "router_rss_mb_before": round(rss_before, 1),
        "router_rss_mb_after": round(rss_mb(pid), 1),
        "health_alone_median_s": round(statistics.median(alone), 4),
        "health_during_max_s": round(max(during), 4) if during else None,
        "health_during_median_s": round(statistics.median(during), 4) if during else None,
        "health_during_over_alone": round(statistics.median(during) / statistics.median(alone), 2) if during else None,
    }


def held_open(addr: tuple[str, int], count: int, first: bytes, limit_s: float, trickle: bytes = b"") -> dict:
    socks = [socket.create_connection(addr, timeout=60) for _ in range(count)]
    t0 = time.monotonic()
    for s in socks:
        if first:
            s.sendall(first)
    statuses: list[int | None] = []
    closed_at: list[float | None] = []
    if trickle:  # one socket, fed until closed
        s = socks[0]
        while time.monotonic() - t0 < limit_s:
            try:
                s.sendall(trickle)
            except (BrokenPipeError, ConnectionResetError):
                break
            s.settimeout(0.2)
            try:
                data = s.recv(65536)
            except TimeoutError:
                continue
            rest, _ = until_closed(s, 5)
            statuses.append(status_of(data + rest))
            closed_at.append(time.monotonic() - t0)
            break
        else:
            statuses.append(None)
            closed_at.append(None)
    else:
        for s in socks:
            data, when = until_closed(s, max(0.1, limit_s - (time.monotonic() - t0)))
            statuses.append(status_of(data))
            closed_at.append(None if when is None else time.monotonic() - t0)
    for s in socks:
        s.close()
    closed = [c for c in closed_at if c is not None]
    return {
        "sockets": count,
        "closed": len(closed),
        "last_closed_s": round(max(closed), 2) if closed else None,
        "statuses": sorted({str(x) for x in statuses}),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "http_hostile.json"))
    ap.add_argument("--big-mb", type=int, default=128)
    args = ap.parse_args()
    limits = HttpLimits.from_env()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "router", "--port", str(port), "--host", "127.0.0.1", "--discovery", "static"]
    cmd += ["--decode-urls", "http://127.0.0.1:9"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    addr = ("127.0.0.1", port)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                health_s(addr)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
                time.sleep(0.2)
        wait = limits.header_timeout_s * 3 + 5
        result = {
            "limits": limits.__dict__,
            "big_header": big_header(addr, proc.pid, args.big_mb << 20),
            "one_mb_header": one_request(
                addr, b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * (1 << 20) + b"\r\n\r\n"
            ),
            "ten_thousand_headers": one_request(
                addr,
                b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(10000)) + b"\r\n",
            ),
            "partial_request_lines": held_open(addr, 300, b"GET /hea", wait),
            "silent_socket": held_open(addr, 1, b"", wait),
            "never_ending_chunked_body": held_open(
                addr,
                1,
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
                limits.body_timeout_s * 3 + 5,
                trickle=b"1\r\n \r\n",
            ),
            "health_after": round(health_s(addr), 4),
        }
    finally:
        proc.terminate()
        proc.wait(30)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
