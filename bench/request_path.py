"""Which of the project's source files one streamed request runs, process by process.

A local cluster (1 prefill + 1 decode worker, router, Redis) runs with a profile hook in every Python process
(router, both control planes, both engine processes): each notes, per project file, the 50 ms slots in which
any of its functions ran (a call, or a coroutine resumed). After a warm-up request, an idle window and one
streamed, disaggregated chat request of the same length are compared: the files that ran in the request's
window, and of those the ones that did not also run while idle (the engine loops, load reports and
heartbeats run either way). Prints both counts per process and in all, and writes JSON.

    python bench/request_path.py [--out bench/out/request_path_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.default_model import DEFAULT_MODEL_NAME  # noqa: E402
from common.devcluster.cluster import start_local_cluster  # noqa: E402

SLOT_S = 0.05
HOOK = """
import json, os, sys, threading, time
_out, _root = os.environ["REQUEST_PATH_TRACE_DIR"], os.environ["REQUEST_PATH_TRACE_ROOT"]
_seen = {}
def _prof(frame, event, arg):
    if event == "call":
        fn = frame.f_code.co_filename
        if fn.startswith(_root) and "/tests/" not in fn and "/bench/" not in fn:
            _seen.setdefault(fn, set()).add(int(time.time() / SLOT))
def _dump():
    path = os.path.join(_out, f"{os.getpid()}.json")
    while True:
        time.sleep(0.3)
        import multiprocessing
        engine = multiprocessing.parent_process() is not None  # a worker's engine (spawned: the parent's argv)
        data = {"argv": sys.argv, "engine": engine, "files": {f: sorted(s) for f, s in list(_seen.items())}}
        with open(path + ".tmp", "w") as fh:
            json.dump(data, fh)
        os.replace(path + ".tmp", path)
sys.setprofile(_prof)
threading.setprofile(_prof)
threading.Thread(target=_dump, daemon=True).start()
""".replace("SLOT", repr(SLOT_S))


def prompt(words: int) -> str:
    filler = " ".join(("river", "mountain", "valley", "forest", "meadow", "harbor")[i % 6] for i in range(words))
    return f"[{time.time_ns()}] Summarize this travel log: {filler}"


def stream_chat(router_url: str, words: int) -> int:
    body = {
        "model": DEFAULT_MODEL_NAME,
        "messages": [{"role": "user", "content": prompt(words)}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    chunks = 0
    with httpx.stream("POST", f"{router_url}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
    return chunks


def process_name(argv: list[str], engine: bool) -> str:
    role = argv[1] if len(argv) > 1 else "?"
    if role == "router":
        return "router"
    return f"{role} {'engine' if engine else 'control plane'}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "request_path_cpu.json"))
    ap.add_argument("--words", type=int, default=400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hook_dir, trace_dir = Path(tmp, "hook"), Path(tmp, "trace")
        hook_dir.mkdir()
        trace_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(HOOK)
        env = {
            "PYTHONPATH": os.pathsep.join([str(hook_dir), str(ROOT)]),
            "REQUEST_PATH_TRACE_DIR": str(trace_dir),
            "REQUEST_PATH_TRACE_ROOT": str(ROOT) + os.sep,
            "KVFERRY_NUM_PAGES": "512",
        }
        with start_local_cluster(prefill=1, decode=1, env=env, ready_timeout_s=600) as c:
            stream_chat(c.router_url, args.words)  # warm-up: first-use paths (handshake, compiles) stay out
            time.sleep(2.0)
            t0 = time.time()
            chunks = stream_chat(c.router_url, args.words)
            t1 = time.time()
            time.sleep(1.0)
            i0 = time.time()
            time.sleep(t1 - t0)
            i1 = time.time()
            time.sleep(1.0)
            dumps = [json.loads(p.read_text()) for p in trace_dir.glob("*.json")]
    window = (int(t0 / SLOT_S), int(t1 / SLOT_S) + 1)
    idle = (int(i0 / SLOT_S), int(i1 / SLOT_S) + 1)
    result: dict[str, object] = {
        "request_s": round(t1 - t0, 3),
        "sse_chunks": chunks,
        "processes": {},
    }
    every, every_only = set(), set()
    for d in dumps:
        files = d["files"]
        ran = {f for f, slots in files.items() if any(window[0] <= s <= window[1] for s in slots)}
        idle_ran = {f for f, slots in files.items() if any(idle[0] <= s <= idle[1] for s in slots)}
        if not ran:
            continue
        rel = sorted(str(Path(f).relative_to(ROOT)) for f in ran)
        only = sorted(str(Path(f).relative_to(ROOT)) for f in ran - idle_ran)
        name = process_name(d["argv"], d["engine"])
        result["processes"][name] = {"files": rel, "not_while_idle": only}  # type: ignore[index]
        every |= set(rel)
        every_only |= set(only)
        print(f"{name:24s} {len(rel):3d} files ran in the request's window, {len(only):3d} not while idle")
    result["files_total"] = len(every)
    result["files_not_while_idle"] = len(every_only)
    result["all_files"] = sorted(every)
    print(f"{'all processes':24s} {len(every):3d} distinct files, {len(every_only):3d} not while idle")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
