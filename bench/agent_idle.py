"""CPU an idle NIXL agent burns, by progress-thread delay (what a worker costs while it waits for requests).

    python bench/agent_idle.py [--seconds 5] [--delays 0,100,1000]

One `KVTransferAgent` over a small DRAM pool per delay, in a fresh process each (NIXL keeps process-wide
state), sitting idle; reports process CPU time / wall time. The ratio is the busy-loop (delay 0) share
over each delay's, measured in the same run. Writes bench/out/agent_idle.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def idle_fraction(delay_us: int, seconds: float) -> float:
    code = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
import torch
from common.kv.pool import KVLayout, KVPool
from common.transfer.agent import KVTransferAgent
pool = KVPool(KVLayout(2, 1, 64, 16, torch.float32), 64)
agent = KVTransferAgent("idle-probe", pool, progress_delay_us={delay_us})
time.sleep(0.5)
c0, w0 = time.process_time(), time.monotonic()
time.sleep({seconds})
print((time.process_time() - c0) / (time.monotonic() - w0))
agent.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--delays", default="0,100,1000")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "agent_idle.json")
    args = ap.parse_args()
    rows = []
    for d in (int(x) for x in args.delays.split(",")):
        frac = idle_fraction(d, args.seconds)
        rows.append({"progress_delay_us": d, "cpu_cores_idle": frac})
        print(f"progress delay {d:>5} us: idle agent uses {frac:.3f} of a core", flush=True)
    base = next((r["cpu_cores_idle"] for r in rows if r["progress_delay_us"] == 0), None)
    for r in rows:
        r["busy_loop_over_this"] = base / r["cpu_cores_idle"] if base and r["cpu_cores_idle"] > 0 else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
