"""Prefix-cache hit rate and TTFT of cache-aware routing against round-robin, and against an oracle.

    python bench/prefix_routing.py                                   # 2 prefill workers, CPU, small
    python bench/prefix_routing.py --prefill 4 --prompts 8 --prefix-tokens 1024 --users 24 \\
        --device cuda --model dummy:smollm2-135m --tokenizer DIR      # the full workload on a GPU

Workload (seeded): ``--prompts`` system prompts of about ``--prefix-tokens`` tokens each (distinct from
their first words), each followed by ``--users`` different short user questions; the requests are
shuffled and sent ``--concurrency`` at a time through the router's OpenAI API (chat, streaming, a few
output tokens). For each routing mode a fresh local cluster is started (real redis-server, real
workers, cold caches): ``cache_aware`` (the router's policy) and ``round_robin`` (prefill pods in turn).
The prefill workers' KV pools hold about 1.3x their fair share of the system prompts, not all of them,
so a placement that scatters a prefix over every pod evicts, as it would in a loaded fleet. The router
is set never to prefill on the decode pod because that pod holds the prefix, so every long prompt is
placed on a prefill pod: the placement is what is measured.

Reported per mode: prefix-cache hit rate (sum of cached prompt tokens / sum of prompt tokens, from each
response's usage.prompt_tokens_details.cached_tokens), TTFT p50/p90 (first content chunk), wall time.
The oracle hit rate assumes perfect placement and enough cache: every request finds, page-aligned, the
longest prefix it shares with any earlier request of its group; the ratio cache_aware / oracle is the
target (>= 0.9). With concurrency > 1 no placement can reach it: requests of a group sent while that
group's first request is still prefilling find nothing cached anywhere. So each mode also reports a
timed oracle (the same, but only counting earlier requests whose first token came out before this one
was sent, in that mode's own run). Writes bench/out/prefix_routing.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

OUT_DIR = Path(__file__).resolve().parent / "out"
WORDS = (
    "ocean river mountain forest desert valley island canyon glacier meadow prairie volcano harbor "
    "lantern compass anchor beacon signal thunder lightning breeze shadow crystal marble granite copper "
    "silver golden amber violet crimson indigo scarlet emerald velvet cotton linen silk wool leather "
    "engine turbine piston gear lever pulley spring valve circuit sensor module kernel buffer socket "
    "planet comet meteor nebula galaxy orbit eclipse horizon zenith equator tropic polar arctic"
).split()


def make_workload(args: argparse.Namespace, tok: Any) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    systems = []
    for g in range(args.prompts):
        words = [f"Group{g}:"]
        while len(tok.encode(" ".join(words))) < args.prefix_tokens:
            words += rng.sample(WORDS, 12)
        systems.append(f"You are assistant number {g}. Background notes: " + " ".join(words))
    requests = []
    for g, system in enumerate(systems):
        for u in range(args.users):
            q = f"User {u} asks: what about the {rng.choice(WORDS)} and the {rng.choice(WORDS)}?"
            requests.append(
                {"group": g, "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
            )
    rng.shuffle(requests)
    for r in requests:
        r["ids"] = tok.encode_chat(r["messages"])
    return requests


def oracle_cached(requests: list[dict[str, Any]], page: int) -> list[int]:
    """Per request: page-aligned longest common prefix with an earlier request of the same group (and
    never the whole prompt: at least one token is always computed)."""
    seen: dict[int, list[list[int]]] = {}
    out = []
    for r in requests:
        ids = r["ids"]
        best = 0
        for prev in seen.get(r["group"], []):
            n = 0
            for a, b in zip(ids, prev, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        best = min(best, len(ids) - 1)
        out.append(best // page * page)
        seen.setdefault(r["group"], []).append(ids)
    return out


async def run_requests(
    url: str, model: str, requests: list[dict[str, Any]], concurrency: int, max_tokens: int
) -> list[dict[str, Any]]:
    sem = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = [{} for _ in requests]
    origin = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(i: int, r: dict[str, Any]) -> None:
            body = {
                "model": model,
                "messages": r["messages"],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with sem:
                t0 = time.perf_counter()
                ttft = None
                usage = None
                async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"request failed: {resp.status_code} {await resp.aread()!r}")
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                            ttft = time.perf_counter() - t0
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                total = time.perf_counter() - t0
            assert usage is not None
            results[i] = {
                "group": r["group"],
                "sent_s": t0 - origin,
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "ttft_s": ttft if ttft is not None else total,
                "latency_s": total,
            }

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return results


def timed_oracle(requests: list[dict[str, Any]], results: list[dict[str, Any]], page: int) -> int:
    """Cached tokens an oracle placement could get in this run's timing: a request can only reuse the
    prefix of an earlier request of its group whose prefill had finished (first token out) before this
    one was sent; requests of a group sent while its first one is still prefilling miss anywhere."""
    total = 0
    for i, r in enumerate(requests):
        ids, best = r["ids"], 0
        for j, q in enumerate(requests):
            if j == i or q["group"] != r["group"]:
                continue
            if results[j]["sent_s"] + results[j]["ttft_s"] > results[i]["sent_s"]:
                continue
            n = 0
            for a, b in zip(ids, q["ids"], strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        total += min(best, len(ids) - 1) // page * page
    return total


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run_mode(
    args: argparse.Namespace, mode: str, requests: list[dict[str, Any]], pages: dict[str, int]
) -> dict[str, Any]:
    from common.devcluster.cluster import start_local_cluster

    env = {"KVFERRY_DEVICE": args.device, "KVFERRY_PAGE_SIZE": str(args.page_size)}
    if args.max_prefill_tokens:
        env["KVFERRY_MAX_PREFILL_TOKENS"] = str(args.max_prefill_tokens)
    router_env = {
        "KVFERRY_ROUTER_ROUTING": mode,
        "KVFERRY_ROUTER_LOCAL_PREFIX_FRACTION": "2",
        "KVFERRY_ROUTER_DISAGG_MIN_PROMPT_TOKENS": "64",
    }
    if args.tokenizer:
        router_env["KVFERRY_ROUTER_TOKENIZER"] = args.tokenizer
    role_env = {
        "prefill": {"KVFERRY_NUM_PAGES": str(pages["prefill"])},
        "decode": {"KVFERRY_NUM_PAGES": str(pages["decode"])},
        "router": router_env,
    }
    say = (lambda m: print(m, file=sys.stderr)) if args.verbose else None
    t_start = time.perf_counter()
    with start_local_cluster(
        prefill=args.prefill,
        decode=args.decode,
        model=args.model,
        env=env,
        role_env=role_env,
        progress=say,
        ready_timeout_s=900,
    ) as cluster:
        startup = time.perf_counter() - t_start
        # Warm-up outside the workload (JIT, first connections): one unrelated short request per decode pod.
        warm = [{"group": -1, "messages": [{"role": "user", "content": "hello"}], "ids": []}] * (2 * args.decode)
        asyncio.run(run_requests(cluster.router_url, args.model, warm, args.decode, 2))
        t0 = time.perf_counter()
        results = asyncio.run(run_requests(cluster.router_url, args.model, requests, args.concurrency, args.max_tokens))
        wall = time.perf_counter() - t0
        stats = httpx.get(f"{cluster.router_url}/router/workers").json()
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    ttft = [r["ttft_s"] for r in results]
    timed = timed_oracle(requests, results, args.page_size)
    return {
        "mode": mode,
        "hit_rate": round(cached / prompt, 4),
        "timed_oracle_hit_rate": round(timed / prompt, 4),
        "hit_rate_vs_timed_oracle": round(cached / max(timed, 1), 4),
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "ttft_p50_ms": round(pct(ttft, 50) * 1e3, 2),
        "ttft_p90_ms": round(pct(ttft, 90) * 1e3, 2),
        "ttft_mean_ms": round(statistics.fmean(ttft) * 1e3, 2),
        "wall_s": round(wall, 2),
        "startup_s": round(startup, 1),
        "decisions": stats["decisions"],
        "per_request": results if args.per_request else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4, help="distinct system prompts")
    p.add_argument("--prefix-tokens", type=int, default=384, help="tokens per system prompt")
    p.add_argument("--users", type=int, default=6, help="requests per system prompt")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-prefill-tokens", type=int, default=0)
    p.add_argument("--share", type=float, default=1.3, help="prefill KV pool = this x its fair share of prefixes")
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokenizer", default="", help="tokenizer dir (for dummy:<config> models)")
    p.add_argument("--modes", default="cache_aware,round_robin")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-request", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--out", type=Path, default=OUT_DIR / "prefix_routing.json")
    args = p.parse_args()

    from router.surface.tokenizer import load_tokenizer

    tok, _ = load_tokenizer(args.model, args.tokenizer)
    requests = make_workload(args, tok)
    oracle = oracle_cached(requests, args.page_size)
    total_prompt = sum(len(r["ids"]) for r in requests)
    prefix_pages = -(-max(len(r["ids"]) for r in requests) // args.page_size)
    fair = -(-args.prompts // args.prefill)  # system prompts per prefill pod under perfect placement
    pages = {
        # fair share x --share, plus one prompt's worth for a miss being prefilled, plus the suffixes
        "prefill": int(fair * prefix_pages * args.share) + prefix_pages + args.concurrency * 4,
        "decode": max(256, 2 * args.concurrency * (prefix_pages + args.max_tokens // args.page_size + 2)),
    }
    result: dict[str, Any] = {
        "workload": {
            "prompts": args.prompts,
            "prefix_tokens": args.prefix_tokens,
            "users_per_prompt": args.users,
            "requests": len(requests),
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "prompt_tokens_total": total_prompt,
            "prefill_workers": args.prefill,
            "decode_workers": args.decode,
            "kv_pages": pages,
            "page_size": args.page_size,
            "device": args.device,
            "model": args.model,
            "seed": args.seed,
        },
        "oracle": {"hit_rate": round(sum(oracle) / total_prompt, 4), "cached_tokens": sum(oracle)},
        "env": {"python": platform.python_version(), "cpu_count": os.cpu_count(), "machine": platform.machine()},
        "modes": {},
    }
    print(
        f"{len(requests)} requests, {total_prompt} prompt tokens; oracle hit rate {result['oracle']['hit_rate']:.3f}",
        file=sys.stderr,
    )
    for mode in args.modes.split(","):
        res = run_mode(args, mode, requests, pages)
        result["modes"][mode] = res
        print(
            f"{mode:12s} hit rate {res['hit_rate']:.3f} ({res['hit_rate'] / result['oracle']['hit_rate']:.2f} of oracle, "
            f"{res['hit_rate_vs_timed_oracle']:.2f} of the timed oracle), "
            f"TTFT p50 {res['ttft_p50_ms']:.0f} ms p90 {res['ttft_p90_ms']:.0f} ms, wall {res['wall_s']:.1f} s",
            file=sys.stderr,
        )
    o = result["oracle"]["hit_rate"]
    modes = result["modes"]
    summary: dict[str, Any] = {m: round(v["hit_rate"] / o, 3) for m, v in modes.items()}
    result["hit_rate_vs_oracle"] = summary
    if "cache_aware" in modes and "round_robin" in modes:
        ca, rr = modes["cache_aware"], modes["round_robin"]
        result["cache_aware_vs_round_robin"] = {
            "hit_rate_ratio": round(ca["hit_rate"] / max(rr["hit_rate"], 1e-9), 3),
            "ttft_p50_ratio": round(ca["ttft_p50_ms"] / rr["ttft_p50_ms"], 3),
            "ttft_p90_ratio": round(ca["ttft_p90_ms"] / rr["ttft_p90_ms"], 3),
            "wall_ratio": round(ca["wall_s"] / rr["wall_s"], 3),
        }
    if "cache_aware" in modes:
        result["target"] = {"hit_rate_vs_oracle_min": 0.9, "met": summary["cache_aware"] >= 0.9}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("oracle", "hit_rate_vs_oracle") if k in result}), file=sys.stderr)
    if "cache_aware_vs_round_robin" in result:
        print(json.dumps(result["cache_aware_vs_round_robin"]), file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
