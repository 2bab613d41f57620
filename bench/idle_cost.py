"""CPU an idle local cluster burns: each worker's engine and control process, the router, over a quiet window.

    python bench/idle_cost.py [--prefill 1] [--decode 1] [--seconds 10] [--out bench/out/idle_cost.json]

Starts `kvferry up`'s cluster (common/devcluster/), sends one disaggregated request through it (so every
loop has been busy and gone idle again), waits for every page back, then reads each process's user+system CPU
ticks from /proc/<pid>/stat at the start and end of the window. Reports percent of one core per process, the
engines' total, and each engine's loop turns per second (from /load) over the same window.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.devcluster.cluster import start_local_cluster  # noqa: E402
from prefill_worker.liveness import process_cpu_ticks  # noqa: E402

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def load(url: str) -> dict:
    return httpx.get(f"{url}/load", timeout=5).json()


def wait_idle(urls: list[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        loads = [load(u) for u in urls]
        if all(ld["free_pages"] == ld["total_pages"] and ld["running_requests"] == 0 for ld in loads):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the cluster did not go idle: {loads}")
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", default=str(REPO / "bench/out/idle_cost.json"))
    args = ap.parse_args()
    env = {"KVFERRY_ROUTER_DISAGG_MIN_PROMPT_TOKENS": "64", "KVFERRY_LOG_LEVEL": "WARNING"}
    cluster = start_local_cluster(prefill=args.prefill, decode=args.decode, env=env, ready_timeout_s=600)
    try:
        body = {"model": "smollm2-135m-instruct", "prompt": "Tell me about the sea. " * 30, "max_tokens": 4}
        r = httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        urls = cluster.prefill_urls + cluster.decode_urls
        wait_idle(urls)
        time.sleep(2.0)  # past the one-off idle work (allocator trim, ledger check)
        procs: dict[str, int] = {}
        for part in cluster.workers:
            assert part.proc is not None
            procs[f"{part.name} control"] = part.proc.pid
            for i, child in enumerate(children(part.proc.pid)):
                procs[f"{part.name} engine" + (f" {i}" if i else "")] = child
        router = next(p for p in cluster.parts if p.url == cluster.router_url)
        assert router.proc is not None
        procs["router"] = router.proc.pid
        turns0 = {u: load(u).get("loop_turns", 0) for u in urls}
        ticks0 = {name: process_cpu_ticks(pid) or 0 for name, pid in procs.items()}
        t0 = time.monotonic()
        time.sleep(args.seconds)
        ticks1 = {name: process_cpu_ticks(pid) or 0 for name, pid in procs.items()}
        wall = time.monotonic() - t0
        turns1 = {u: load(u).get("loop_turns", 0) for u in urls}
        percent = {name: round(100 * (ticks1[name] - ticks0[name]) / TICKS_PER_S / wall, 2) for name in procs}
        result = {
            "prefill": args.prefill,
            "decode": args.decode,
            "seconds": round(wall, 2),
            "percent_of_one_core": percent,
            "engines_total_percent": round(sum(v for k, v in percent.items() if "engine" in k), 2),
            "controls_total_percent": round(sum(v for k, v in percent.items() if "control" in k), 2),
            "loop_turns_per_s": {u: round((turns1[u] - turns0[u]) / wall, 2) for u in urls},
            "clock_ticks_per_s": TICKS_PER_S,
        }
    finally:
        cluster.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
