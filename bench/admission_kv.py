"""A normal request beside large ones, on a real local cluster (router + one decode worker, CPU, packaged model).

    python bench/admission_kv.py [--pages 256] [--out bench/out/admission_kv.json]

Measures a normal chat (16-token answer) alone, then sends a mix of large streaming requests (n=16 x 7,000
max_tokens, n=8 x 2,000 six times, and requests within the per-request share) and, while the accepted ones
stream, the same normal chat again. Prints what each large request got (400 / 429 / streaming) and the ratio
of the normal request's latency beside them to its idle latency, measured in this run; saves the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.devcluster.cluster import start_local_cluster  # noqa: E402

MODEL = "smollm2-135m-instruct"


def chat(max_tokens: int, n: int = 1, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] Tell me a story."}],
        "max_tokens": max_tokens,
        "n": n,
        "ignore_eos": True,
        "stream": stream,
    }


def normal_s(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=chat(16), timeout=300)
    r.raise_for_status()
    return time.perf_counter() - t0


def hold(url: str, body: dict[str, Any], out: dict[str, Any], stop: threading.Event) -> None:
    """Streams `body` until `stop` (closing it: the worker aborts it); records its status or refusal."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            out["error"] = json.loads(r.read())["error"]["message"]
            out["retry_after"] = r.headers.get("retry-after")
        out["status"] = r.status_code
        if r.status_code == 200:
            for _ in r.iter_lines():
                if stop.is_set():
                    return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=1456, help="decode KV pages (the packaged CPU default: 1,456)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/out/admission_kv.json")
    args = ap.parse_args()
    env = {"KVFERRY_NUM_PAGES": str(args.pages), "KVFERRY_PAGE_SIZE": "16"}
    c = start_local_cluster(prefill=0, decode=1, env=env, ready_timeout_s=600)
    try:
        url = c.router_url
        while not all(w["up"] for w in httpx.get(f"{url}/router/workers").json()["workers"]):
            time.sleep(0.1)
        pool = args.pages * 16
        normal_s(url)  # warm
        idle = [normal_s(url) for _ in range(args.rounds)]
        mix = [("n=16 x 7000", chat(7000, 16, True))]
        mix += [("n=8 x 2000", chat(2000, 8, True)) for _ in range(6)]
        mix += [(f"n=1 x {m}", chat(m, 1, True)) for m in (pool // 4, pool // 4, pool // 8, pool // 8, pool // 16)]
        stop = threading.Event()
        results: list[dict[str, Any]] = []
        threads = []
        for name, body in mix:
            out: dict[str, Any] = {"request": name}
            t = threading.Thread(target=hold, args=(url, body, out, stop), daemon=True)
            t.start()
            results.append(out)
            threads.append(t)
        deadline = time.monotonic() + 300
        while any("status" not in r for r in results) and time.monotonic() < deadline:
            time.sleep(0.05)
        beside = [normal_s(url) for _ in range(args.rounds)]
        streaming_after = sum(1 for r in results if r.get("status") == 200)
        stop.set()
        for t in threads:
            t.join(60)
        ratio = statistics.median(beside) / statistics.median(idle)
        report = {
            "pool_tokens": pool,
            "idle_s": [round(x, 3) for x in idle],
            "beside_s": [round(x, 3) for x in beside],
            "ratio_median": round(ratio, 2),
            "large_requests": results,
            "large_streaming": streaming_after,
        }
        for r in results:
            print(f"{r['request']:>14}: {r.get('status')}  {r.get('error', '')[:110]}")
        print(
            f"normal chat alone {statistics.median(idle):.2f} s, beside the large ones {statistics.median(beside):.2f} s"
        )
        print(f"ratio (beside / alone, median of {args.rounds}): {ratio:.2f}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    finally:
        c.stop()


if __name__ == "__main__":
    main()
