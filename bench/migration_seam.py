"""The pause a client sees when its decode worker dies mid-stream, against the stream's own inter-token gap.

    python bench/migration_seam.py            # CPU, the embedded model

A local cluster (1 prefill worker, N decode workers, the router), a greedy 120-token stream, its decode worker
killed with -9 after 20 chunks; the parts are supervised as `kvferry up` does (common/devcluster/supervisor.py),
so the killed worker comes back. Measured per N (2: another decode worker takes the stream at once; 1: the
stream waits for the restarted worker): the largest gap between chunks (the seam) over the median gap before
the kill, and whether the text equals a fault-free run's. Writes `bench/out/migration_seam_<device>.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's packages, not bench/

from common.devcluster.cluster import LocalCluster, start_local_cluster  # noqa: E402
from common.devcluster.supervisor import Supervisor  # noqa: E402

MODEL = "smollm2-135m-instruct"
ENV = {"KVFERRY_NUM_PAGES": "256", "KVFERRY_PAGE_SIZE": "16"}
KILL_AFTER = 20


def _sse(resp: httpx.Response) -> Any:
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)


def _busy_decode(c: LocalCluster) -> str:
    deadline = time.monotonic() + 5.0  # load snapshots are ~0.1 s old
    while time.monotonic() < deadline:
        for u in c.decode_urls:
            if httpx.get(f"{u}/load", timeout=5).json()["running_requests"]:
                return u
        time.sleep(0.02)
    raise RuntimeError("no decode worker is running the stream")


def measure(decode: int, max_tokens: int) -> dict[str, Any]:
    c = start_local_cluster(prefill=1, decode=decode, model=MODEL, env=ENV, ready_timeout_s=300)
    supervisor = Supervisor(c.workers)
    stop = threading.Event()

    def supervise() -> None:
        while not stop.wait(0.5):
            supervisor.check()

    threading.Thread(target=supervise, daemon=True).start()
    try:
        body = {"model": MODEL, "prompt": "Tell me a very long story about a lighthouse keeper.", "temperature": 0}
        body.update(max_tokens=max_tokens, ignore_eos=True)
        url = f"{c.router_url}/v1/completions"
        reference = httpx.post(url, json=body, timeout=300).json()["choices"][0]["text"]
        arrivals: list[float] = []
        text = ""
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as r:
            for ev in _sse(r):
                if ev == "[DONE]":
                    break
                if "error" in ev:
                    raise RuntimeError(f"the stream failed: {ev}")
                arrivals.append(time.monotonic())
                text += ev["choices"][0]["text"]
                if len(arrivals) == KILL_AFTER:
                    victim = next(p for p in c.workers if p.url == _busy_decode(c))
                    victim.kill_group()
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        itl = statistics.median(gaps[: KILL_AFTER - 1])
        seam = max(gaps)
        return {
            "decode_workers": decode,
            "same_text_as_fault_free": text == reference,
            "chunks": len(arrivals),
            "median_gap_before_kill_s": round(itl, 4),
            "seam_gap_s": round(seam, 3),
            "seam_over_median_gap": round(seam / itl, 1),
            "restarts": supervisor.restarts,
        }
    finally:
        stop.set()
        c.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=120)
    args = p.parse_args()
    results = [measure(n, args.max_tokens) for n in (2, 1)]
    for r in results:
        print(
            f"{r['decode_workers']} decode worker(s): seam {r['seam_gap_s']:.3f} s = {r['seam_over_median_gap']}x "
            f"the median gap ({r['median_gap_before_kill_s'] * 1000:.0f} ms); same text: {r['same_text_as_fault_free']}"
        )
    out = ROOT / "bench" / "out" / "migration_seam_cpu.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": MODEL, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
