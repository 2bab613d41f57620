"""Router overhead: added latency against calling a decode worker directly, and routing decisions/s.

    python bench/router.py                  # stub decode worker (isolates the router), 2000 requests
    python bench/router.py --real           # also against a real decode worker (the embedded model, CPU)
    python bench/router.py --requests 500 --out bench/out/router.json

Added latency. A decode worker and the router run as separate processes, as in a deployment (router
started with `kvferry router`, a real redis-server for the prefix index, so every routed request pays the
Redis round trip, the tokenizer, block hashing, policy, SSE/JSON framing). One client sends requests one
at a time, alternating between
  - direct: POST {decode}/internal/generate with the prompt's token ids (tokenized once, up front),
    reading the NDJSON stream to the end;
  - routed: POST {router}/v1/completions with the prompt text (non-streaming, and streaming with SSE),
and reports p50/p99 of each and of the difference. The zero-cost worker (bench/fake_worker.py) answers
instantly, so its numbers are the router's cost alone; `--real` repeats the comparison against the real
worker, where model time adds noise to both sides.

Routing decisions per second, on one core (the process pinned to one CPU): the policy alone (4 prefill +
4 decode candidates); the router's in-process decision for a 1k-token prompt (block hashes + the
router's own placement memory + policy); and the same plus the Redis match (one EVALSHA round trip to a
local redis-server), i.e. what one router process can route per second when each decision runs alone.

Streaming capacity (`--capacity`, or `--capacity-only` to skip the rest): many concurrent clients
(bench/router_load.py: several client processes, closed-loop SSE streams of `--stream-tokens` tokens)
through the router to stepping fake decode workers (one event per stream every `--step-s`, like an
engine's decode step), once per router process count in `--router-processes` (KVFERRY_ROUTER_WORKERS).
Reports the tokens/s the clients received, the router's CPU (all its processes) and so its tokens per
CPU-second, TTFT and the gaps between a client's reads (ITL) against the worker's step. Offer more than
the router can carry (streams / step_s above the target) to see its ceiling.

Targets (issue 13): one router process streams >= 50k tokens/s; p50 added latency <= 1 ms (the short
prompt, non-streamed, against the zero-cost worker). Both are printed with their ratio to the target.

Writes bench/out/router.json.

    python bench/router.py --capacity --router-processes 1,2,4 --streams 1500 --client-procs 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

OUT_DIR = Path(__file__).resolve().parent / "out"
MODEL = "smollm2-135m-instruct"
PROMPT = (
    "You are a helpful assistant. Summarize the following paragraph in one sentence: "
    "The quick brown fox jumps over the lazy dog while the cat watches from the window. " * 3
)
# Long enough (> the 256-token disaggregation threshold) to take the full path: Redis prefix lookup and a
# prefill pod chosen (the stub decode worker ignores the prefill URL it is handed).
LONG_PROMPT = PROMPT * 6


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), to report the router's cost per request
    independently of how busy the machine is."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summary_ms(xs: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(pct(xs, 50) * 1e3, 3),
        "p90_ms": round(pct(xs, 90) * 1e3, 3),
        "p99_ms": round(pct(xs, 99) * 1e3, 3),
        "mean_ms": round(statistics.fmean(xs) * 1e3, 3),
    }


def wait_ready(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


# ---- added latency -----------------------------------------------------------------------------------
def measure_latency(
    router_url: str,
    decode_url: str,
    prompt: str,
    token_ids: list[int],
    n: int,
    max_tokens: int,
    router_pid: int | None = None,
) -> dict[str, Any]:
    gen_body = {
        "req_id": "bench",
        "token_ids": token_ids,
        "sampling": {"max_tokens": max_tokens, "temperature": 0.0},
        "prefill_url": None,
    }
    comp = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    direct, routed, routed_sse = [], [], []
    with httpx.Client(timeout=120) as c:

        def run_direct(i: int) -> float:
            t = time.perf_counter()
            with c.stream("POST", f"{decode_url}/internal/generate", json={**gen_body, "req_id": f"b{i}"}) as r:
                for line in r.iter_lines():
                    if line and json.loads(line).get("finish_reason"):
                        break
            return time.perf_counter() - t

        def run_routed() -> float:
            t = time.perf_counter()
            r = c.post(f"{router_url}/v1/completions", json=comp)
            assert r.status_code == 200, r.text
            return time.perf_counter() - t

        def run_routed_sse() -> float:
            t = time.perf_counter()
            with c.stream("POST", f"{router_url}/v1/completions", json={**comp, "stream": True}) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        break
            return time.perf_counter() - t

        for i in range(max(20, n // 10)):  # warm up connections, caches, the tokenizer
            run_direct(i)
            run_routed()
            run_routed_sse()
        cpu0 = cpu_seconds(router_pid) if router_pid else 0.0
        for i in range(n):  # interleaved, so drift (other load, thermal) hits all three alike
            direct.append(run_direct(i))
            routed.append(run_routed())
            routed_sse.append(run_routed_sse())
        router_cpu_ms = (cpu_seconds(router_pid) - cpu0) / (2 * n) * 1e3 if router_pid else None
    added = [r - d for r, d in zip(routed, direct, strict=True)]
    added_sse = [r - d for r, d in zip(routed_sse, direct, strict=True)]
    return {
        "requests": n,
        "max_tokens": max_tokens,
        "prompt_tokens": len(token_ids),
        "router_cpu_ms_per_request": None if router_cpu_ms is None else round(router_cpu_ms, 3),
        "direct": summary_ms(direct),
        "routed_json": summary_ms(routed),
        "routed_sse": summary_ms(routed_sse),
        "added_json": {
            "p50_ms": round((pct(routed, 50) - pct(direct, 50)) * 1e3, 3),
            "p99_ms": round((pct(routed, 99) - pct(direct, 99)) * 1e3, 3),
            "paired_p50_ms": round(pct(added, 50) * 1e3, 3),
        },
        "added_sse": {
            "p50_ms": round((pct(routed_sse, 50) - pct(direct, 50)) * 1e3, 3),
            "p99_ms": round((pct(routed_sse, 99) - pct(direct, 99)) * 1e3, 3),
            "paired_p50_ms": round(pct(added_sse, 50) * 1e3, 3),
        },
    }


def start(argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def latency_vs_stub(args: argparse.Namespace, tok: Any, redis_url: str, logs: Path) -> dict[str, Any]:
    from common.net import free_port

    dport, pport, rport = free_port(), free_port(), free_port()
    env = dict(os.environ, KVFERRY_LOG_LEVEL="WARNING")
    stub = [sys.executable, str(Path(__file__).resolve().parent / "fake_worker.py")]
    procs = [
        start([*stub, "--port", str(dport), "--pod", "stub-d0"], env, logs / "stub-decode.log"),
        start([*stub, "--role", "prefill", "--port", str(pport), "--pod", "stub-p0"], env, logs / "stub-prefill.log"),
    ]
    try:
        decode_url, prefill_url = f"http://127.0.0.1:{dport}", f"http://127.0.0.1:{pport}"
        wait_ready(decode_url)
        wait_ready(prefill_url)
        router_argv = [sys.executable, "-m", "common.cli", "router", "--port", str(rport), "--redis-url", redis_url]
        router_argv += ["--decode-urls", decode_url, "--prefill-urls", prefill_url]
        if args.tokenizer:
            router_argv += ["--tokenizer", args.tokenizer]
        router = start(router_argv, env, logs / "router.log")
        procs.append(router)
        router_url = f"http://127.0.0.1:{rport}"
        wait_ready(router_url)
        time.sleep(1.5)  # let the pool's first polls mark the prefill stub up too
        out: dict[str, Any] = {}
        for name, prompt in (("short_prompt", PROMPT), ("long_prompt", LONG_PROMPT)):
            ids = tok.encode(prompt)
            out[name] = measure_latency(router_url, decode_url, prompt, ids, args.requests, args.max_tokens, router.pid)
            print(name, json.dumps(out[name], indent=1), file=sys.stderr)
        out["router_decisions"] = httpx.get(f"{router_url}/router/workers").json()["decisions"]
        return out
    finally:
        stop(procs)


def latency_vs_real(args: argparse.Namespace, tok: Any) -> dict[str, Any]:
    from common.devcluster.cluster import start_local_cluster

    with start_local_cluster(prefill=0, decode=1, progress=lambda m: print(m, file=sys.stderr)) as cluster:
        n = max(50, args.requests // 10)
        assert cluster.router is not None and cluster.router.proc is not None
        pid = cluster.router.proc.pid
        return measure_latency(
            cluster.router_url, cluster.decode_urls[0], PROMPT, tok.encode(PROMPT), n, args.max_tokens, pid
        )


# ---- streaming capacity ------------------------------------------------------------------------------
def streaming_capacity(args: argparse.Namespace, redis_url: str, logs: Path) -> dict[str, Any]:
    from bench.router_load import process_tree_cpu_s, run_load
    from common.net import free_port

    env = dict(os.environ, KVFERRY_LOG_LEVEL="WARNING")
    fake = [sys.executable, str(Path(__file__).resolve().parent / "fake_worker.py"), "--step-s", str(args.step_s)]
    ports = [free_port() for _ in range(args.fake_workers)]
    workers = [start([*fake, "--port", str(p)], env, logs / f"fake-{p}.log") for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    # Token ids, as bench/serve.py sends them: each in-flight request then holds lists of that length in the router
    # (what its garbage collections walk); text otherwise.
    prompt: str | list[int] = (
        random.Random(0).choices(range(1000, 40000), k=args.prompt_ids) if args.prompt_ids else PROMPT
    )
    runs: list[dict[str, Any]] = []
    try:
        for u in urls:
            wait_ready(u)
        for n_proc in args.router_processes:
            rport = free_port()
            argv = [sys.executable, "-m", "common.cli", "router", "--port", str(rport), "--redis-url", redis_url]
            argv += ["--decode-urls", ",".join(urls)]
            if args.tokenizer:
                argv += ["--tokenizer", str(Path(args.tokenizer).resolve())]
            renv = dict(env, KVFERRY_ROUTER_WORKERS=str(n_proc))
            if args.router_src:  # another checkout's router, for comparing versions
                renv["PYTHONPATH"] = os.pathsep.join([str(args.router_src), env.get("PYTHONPATH", "")])
            router = start(argv, renv, logs / f"router-x{n_proc}.log", cwd=args.router_src)
            try:
                router_url = f"http://127.0.0.1:{rport}"
                wait_ready(router_url)
                time.sleep(1.0)  # every router process has polled the workers
                cpu0, t0 = process_tree_cpu_s(router.pid), time.monotonic()
                res = run_load(
                    router_url,
                    args.client_procs,
                    args.streams // args.client_procs,
                    args.stream_tokens,
                    prompt,
                    args.warmup_s,
                    args.capacity_seconds,
                )
                cores = (process_tree_cpu_s(router.pid) - cpu0) / (time.monotonic() - t0)
                # The relay lateness the router would send as each request's ITL allowance (common/loop_lag.py),
                # read right after the load: one process's view (each router process keeps its own).
                lag_ms = httpx.get(f"{router_url}/router/workers", timeout=10).json().get("loop_lag_p99_ms")
            finally:
                stop([router])
            collections = slow_collections(logs / f"router-x{n_proc}.log")
            tok_s = res.tokens / args.capacity_seconds
            run = {
                "router_processes": n_proc,
                "streams": args.streams,
                "offered_tok_s": round(args.streams / args.step_s),
                "tok_s": round(tok_s),
                "router_cpu_cores": round(cores, 2),
                "tok_per_router_cpu_s": round(tok_s / cores) if cores > 0 else None,
                "requests": res.requests,
                "errors": res.errors,
                "statuses": res.statuses,
                "first_error": res.first_error or None,
                "ttft": summary_ms(res.ttft_s) if res.ttft_s else None,
                "itl": summary_ms(res.itl_s) if res.itl_s else None,
                "router_loop_lag_p99_ms": lag_ms,
                "slow_collections": len(collections),
                "slow_collection_max_ms": max((c["ms"] for c in collections), default=None),
                "slow_collection_lines": collections[:8],
                "loadavg": list(os.getloadavg()),
            }
            print(json.dumps(run), file=sys.stderr)
            runs.append(run)
    finally:
        stop(workers)
    return {
        "fake_workers": args.fake_workers,
        "step_s": args.step_s,
        "stream_tokens": args.stream_tokens,
        "prompt_ids": args.prompt_ids,
        "client_procs": args.client_procs,
        "seconds": args.capacity_seconds,
        "label": args.label,
        "router_src": str(args.router_src) if args.router_src else None,
        "router_env": {k: v for k, v in os.environ.items() if k.startswith("KVFERRY_ROUTER_")},
        "runs": runs,
    }


def slow_collections(log: Path) -> list[dict[str, Any]]:
    """The router's slow garbage collections from its log: their figures."""
    from bench.gap_sources import slow_collection_fields

    keep = ("generation", "ms", "collected", "objects")
    return [{k: float(v) for k, v in fields.items() if k in keep} for fields in slow_collection_fields(log)]


# ---- decisions per second ------------------------------------------------------------------------------
def decisions_per_second(redis_url: str, seconds: float) -> dict[str, Any]:
    from common.prefix.hashing import chained_block_hashes
    from common.prefix.publisher import PrefixIndexPublisher
    from common.prefix.reader import PrefixIndexReader
    from router.decision.locality import RecentPlacements
    from router.decision.policy import DecodeCandidate, PrefillCandidate, RoutingPolicy

    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        pinned = True
    except (AttributeError, OSError):
        pinned = False
    rng = random.Random(0)
    prefill = [PrefillCandidate(f"http://p{i}", f"p{i}", rng.randint(0, 4000), 0, 0) for i in range(4)]
    decode = [
        DecodeCandidate(f"http://d{i}", f"d{i}", rng.randint(0, 30), 0, 0, rng.randint(100, 900), 1000, 16)
        for i in range(4)
    ]
    pods = [c.pod for c in prefill] + [c.pod for c in decode]
    prompts = [[rng.randrange(49152) for _ in range(1024)] for _ in range(64)]
    policy = RoutingPolicy()
    recent = RecentPlacements(ttl_s=10.0)
    # The index holds the first prompts' blocks on p1, as a worker would have published them.
    pub = PrefixIndexPublisher(redis_url, MODEL, "p1", flush_interval_s=0.01)
    pub.start()
    pub.stored([h for p in prompts[:32] for h in chained_block_hashes(p, 16)])
    pub.wait_idle(10)
    reader = PrefixIndexReader(redis_url, MODEL)
    loop = asyncio.new_event_loop()  # the reader runs on an event loop, as in the router

    def rate(fn: Any) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(50):
                fn(n)
                n += 1
        return n / (time.perf_counter() - t0)

    def policy_only(i: int) -> None:
        policy.choose(1024, 128, 16, prefill, decode, {"p1": 40, "p0": 3})

    def in_process(i: int) -> None:
        hashes = chained_block_hashes(prompts[i % 64], 16)
        matches = recent.match(hashes, pods)
        d = policy.choose(1024, 128, 16, prefill, decode, matches)
        recent.record(d.prefill or d.decode, hashes)

    def with_redis(i: int) -> None:
        hashes = chained_block_hashes(prompts[i % 64], 16)
        matches = loop.run_until_complete(reader.match(hashes, pods)) or {}
        for pod, k in recent.match(hashes, pods).items():
            matches[pod] = max(k, matches.get(pod, 0))
        d = policy.choose(1024, 128, 16, prefill, decode, matches)
        recent.record(d.prefill or d.decode, hashes)

    try:
        return {
            "pinned_to_one_core": pinned,
            "prompt_tokens": 1024,
            "candidates": {"prefill": 4, "decode": 4},
            "policy_only_per_s": round(rate(policy_only)),
            "hash_recent_policy_per_s": round(rate(in_process)),
            "with_redis_match_per_s": round(rate(with_redis)),
        }
    finally:
        pub.stop()
        loop.run_until_complete(reader.aclose())
        loop.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--seconds", type=float, default=3.0, help="per decisions/s measurement")
    p.add_argument("--real", action="store_true", help="also measure against a real decode worker")
    p.add_argument("--tokenizer", default="", help="tokenizer dir (default: the embedded model's)")
    p.add_argument("--out", type=Path, default=OUT_DIR / "router.json")
    cap = p.add_argument_group("streaming capacity")
    cap.add_argument("--capacity", action="store_true", help="also measure streaming capacity")
    cap.add_argument("--capacity-only", action="store_true", help="only measure streaming capacity")
    cap.add_argument("--router-processes", type=lambda v: [int(x) for x in v.split(",")], default=[1])
    cap.add_argument("--streams", type=int, default=1200, help="concurrent client streams")
    cap.add_argument("--client-procs", type=int, default=4)
    cap.add_argument("--fake-workers", type=int, default=4)
    cap.add_argument("--step-s", type=float, default=0.02, help="fake decode step: one event per stream each")
    cap.add_argument("--stream-tokens", type=int, default=256, help="max_tokens of each streamed request")
    cap.add_argument("--prompt-ids", type=int, default=0, help="send a prompt of this many token ids (0: text)")
    cap.add_argument("--warmup-s", type=float, default=3.0)
    cap.add_argument("--capacity-seconds", type=float, default=10.0)
    cap.add_argument("--router-src", type=Path, default=None, help="run the router from this checkout instead")
    cap.add_argument("--label", default="", help="names this capacity run in the JSON (e.g. the router settings)")
    args = p.parse_args()

    import tempfile

    from common.devcluster.redis_server import start_redis_server
    from common.net import free_port
    from router.surface.tokenizer import load_tokenizer

    tok, _ = load_tokenizer(MODEL, args.tokenizer)
    logs = Path(tempfile.mkdtemp(prefix="kvferry-bench-router-"))
    redis_proc = start_redis_server(free_port(), logs / "redis.log")
    redis_url = redis_proc.url or ""
    result: dict[str, Any] = {
        "env": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "loadavg_start": list(os.getloadavg()),
        }
    }
    try:
        if args.capacity or args.capacity_only:
            print("streaming capacity ...", file=sys.stderr)
            result["capacity"] = streaming_capacity(args, redis_url, logs)
        if args.capacity_only:
            return _report(args, result)
        print("added latency vs a stub decode worker ...", file=sys.stderr)
        result["latency_stub"] = latency_vs_stub(args, tok, redis_url, logs)
        if args.real:
            print("added latency vs a real decode worker ...", file=sys.stderr)
            result["latency_real"] = latency_vs_real(args, tok)
            print(json.dumps(result["latency_real"], indent=1), file=sys.stderr)
        print("routing decisions per second (one core) ...", file=sys.stderr)
        result["decisions"] = decisions_per_second(redis_url, args.seconds)
        print(json.dumps(result["decisions"], indent=1), file=sys.stderr)
    finally:
        redis_proc.signal(15)
        redis_proc.kill_group()
    return _report(args, result)


TARGET_TOK_S = 50_000  # one router process
TARGET_ADDED_P50_MS = 1.0


def _report(args: argparse.Namespace, result: dict[str, Any]) -> int:
    result["env"]["loadavg_end"] = list(os.getloadavg())
    targets: dict[str, Any] = {}
    lines = []
    if "latency_stub" in result:
        added = result["latency_stub"]["short_prompt"]["added_json"]["p50_ms"]
        targets["added_p50_ms"] = {
            "value": added,
            "target_max": TARGET_ADDED_P50_MS,
            "ratio": added / TARGET_ADDED_P50_MS,
        }
        lines.append(
            f"added p50 {added:.3f} ms: {added / TARGET_ADDED_P50_MS:.2f} x the {TARGET_ADDED_P50_MS} ms target"
        )
    for run in result.get("capacity", {}).get("runs", []):
        n, tok_s, per_core = run["router_processes"], run["tok_s"], run["tok_per_router_cpu_s"]
        key = f"tok_s_{n}_process" + ("es" if n > 1 else "")
        targets[key] = {"value": tok_s, "target_min": TARGET_TOK_S, "ratio": tok_s / TARGET_TOK_S}
        lines.append(
            f"{n} router process(es): {tok_s} tok/s = {tok_s / TARGET_TOK_S:.2f} x the {TARGET_TOK_S} target "
            f"({run['router_cpu_cores']} cores busy, {per_core} tok per router CPU-second; offered "
            f"{run['offered_tok_s']}; ITL p50 {run['itl'] and run['itl']['p50_ms']} ms at a "
            f"{result['capacity']['step_s'] * 1e3:g} ms step; errors {run['errors']})"
        )
    result["targets"] = targets
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
