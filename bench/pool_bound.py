"""Pool-bound serving under the memory policies: full against optimistic KV reservation (KVFERRY_KV_RESERVATION),
and optimistic's two preemption modes, recompute against parking in the host KV tier (KVFERRY_PREEMPT_MODE):
admitted concurrency, goodput, preemptions, recomputed tokens, and whether any output changed.

    python bench/pool_bound.py                                   # CPU, small: the packaged SmolLM2-135M
    python bench/pool_bound.py --model dummy:llama-3.1-8b --requests 400 --rate 12 \\
        --prompt-tokens 512,3072 --output-tokens 64,512 --pool-fraction 0.1      # the issue's workload, GPU

One engine, one scheduler per policy over the same runner and the same requests (seeded): every request asks
max_tokens `--max-tokens` (4096) and its output ends after a length drawn from `--output-tokens` (the client
stops it there, as a stop string would: the request is aborted with reason "stop", and its pages go back).
Requests arrive as a Poisson process at `--rate` per second (0: all at once). The KV pool is
`--pool-fraction` of the pool the engine sizes by default (its allocator's range is cut; the memory stays), or
`--pool-pages`. Every policy runs with the same host KV tier (`--host-kv-gb`; by default twice the cut pool's
bytes), so the preemption modes differ only in what becomes of a preempted request's KV: recompute leaves it
to the prefix cache (and the tier behind it) and prefills what eviction took; park copies it all to the tier and
back. A request is good when its TTFT <= `--ttft-s` and its own inter-token gaps' p99 <= `--itl-ms`.
Per policy: peak and mean admitted requests (prefilling, decoding), goodput (good requests/s), output tokens/s,
preemptions (and how many parked), the tokens recomputed for them; then the optimistic/full and park/recompute
ratios and whether every request's tokens are equal across the policies (greedy). Wall clock, one process, all
policies in the same run. Writes bench/out/pool_bound.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

OUT_DIR = Path(__file__).resolve().parent / "out"


def span(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def workload(args, vocab: int) -> list[dict[str, Any]]:
    """Seeded requests: arrival time, prompt ids, the output length at which the client stops it."""
    rng = random.Random(args.seed)
    t = 0.0
    out = []
    for i in range(args.requests):
        if args.rate > 0:
            t += rng.expovariate(args.rate)
        n = rng.randint(*args.prompt_tokens)
        out.append(
            {
                "id": f"r{i}",
                "arrival_s": t,
                "prompt": [rng.randrange(10, vocab - 10) for _ in range(n)],
                "stop_after": rng.randint(*args.output_tokens),
            }
        )
    return out


def differing(a: dict[str, list[int]], b: dict[str, list[int]], only: list[str] | None = None) -> dict[str, Any]:
    """How many requests' tokens differ between two runs, and where the first difference falls on average."""
    ids = only if only is not None else list(a)
    firsts = [next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), None) for k in ids]
    hit = [f for f in firsts if f is not None]
    return {"of": len(ids), "differ": len(hit), "mean_first_difference": round(sum(hit) / len(hit), 1) if hit else None}


# name -> (KVFERRY_KV_RESERVATION, KVFERRY_PREEMPT_MODE)
POLICIES = {
    "full": ("full", "recompute"),
    "full_again": ("full", "recompute"),
    "optimistic": ("optimistic", "recompute"),
    "optimistic_park": ("optimistic", "park"),
}


def run_policy(runner: Any, name: str, work: list[dict[str, Any]], args) -> dict[str, Any]:
    from common.protocol import SamplingParams
    from common.sched.request import Req, ReqState
    from common.sched.scheduler import Scheduler
    from common.settings import SchedulerConfig

    reservation, mode = POLICIES[name]
    cfg = SchedulerConfig(
        max_prefill_tokens=args.max_prefill_tokens,
        kv_reservation=reservation,
        preempt_mode=mode,
        host_kv_gb=args.host_kv_gb,
    )
    sched = Scheduler(runner, cfg)
    pending = list(work)
    reqs: dict[str, Req] = {}
    stamps: dict[str, list[float]] = {}
    admitted: list[int] = []
    preempted: set[str] = set()
    start = time.perf_counter()
    cpu_start = time.process_time()
    done = 0
    while done < len(work):
        now = time.perf_counter() - start
        while pending and pending[0]["arrival_s"] <= now:
            w = pending.pop(0)
            sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            r = reqs[w["id"]] = Req(w["id"], list(w["prompt"]), sp)
            stamps[w["id"]] = [start + w["arrival_s"]]
            sched.add(r)
        if not sched.has_work():
            time.sleep(max(0.0, min(0.01, pending[0]["arrival_s"] - now)) if pending else 0.0)
            continue
        events = sched.step()
        t = time.perf_counter()
        admitted.append(sched.table.active_count())
        for e in events:
            stamps[e.req.req_id].extend([t] * len(e.tokens))
            if e.finished:
                done += 1
        for w in work:  # the client's stop: O(requests) per step, the bench's own cost, not the engine's
            r = reqs.get(w["id"])
            if r is not None and r.output_ids and r.state is ReqState.WAITING:
                preempted.add(w["id"])
            if r is not None and not r.finished and len(r.output_ids) >= w["stop_after"]:
                if sched.abort(r.req_id, "stop") is not None:
                    done += 1
    sched.flush()
    elapsed = time.perf_counter() - start
    cpu_s = time.process_time() - cpu_start
    good = 0
    ttfts = []
    for w in work:
        s = stamps[w["id"]]
        ttft = s[1] - s[0] if len(s) > 1 else float("inf")
        ttfts.append(ttft)
        gaps = sorted(b - a for a, b in zip(s[1:], s[2:]))
        p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0
        good += ttft <= args.ttft_s and p99 <= args.itl_ms / 1000
    out_tokens = sum(min(len(r.output_ids), w["stop_after"]) for w, r in ((w, reqs[w["id"]]) for w in work))
    ttfts.sort()
    snap = sched.snapshot()
    result = {
        "policy": name,
        "kv_reservation": reservation,
        "preempt_mode": mode,
        "elapsed_s": round(elapsed, 3),
        # The process's CPU time beside the wall clock (on a shared box both grow with the others' load).
        "cpu_s": round(cpu_s, 3),
        "peak_admitted": max(admitted, default=0),
        "mean_admitted": round(sum(admitted) / max(1, len(admitted)), 2),
        "good_requests": good,
        "goodput_rps": round(good / elapsed, 4),
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4),
        "preemptions": snap.preemptions,
        "preemptions_parked": snap.preemptions_parked,
        "recomputed_tokens": snap.recomputed_tokens,
        "host_pages_saved": snap.host_pages_saved,
        "host_pages_loaded": snap.host_pages_loaded,
        "steps": len(admitted),
        "preempted_ids": sorted(preempted),
        "outputs": {w["id"]: reqs[w["id"]].output_ids[: w["stop_after"]] for w in work},
        "ledger_violations": sched.table_violations(),
    }
    if sched.cache is not None and sched.cache.host is not None:
        sched.cache.host.close()  # unpinned now: the next policy pins a tier of its own
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model path or a packaged model's name")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=0.0, help="arrivals per second (0: all at once)")
    p.add_argument("--prompt-tokens", type=span, default=(32, 96), help="lo,hi")
    p.add_argument("--output-tokens", type=span, default=(16, 64), help="lo,hi: where the client stops a request")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--pool-fraction", type=float, default=0.1, help="of the engine's default KV pool")
    p.add_argument("--pool-pages", type=int, default=0, help="the KV pool in pages (overrides --pool-fraction)")
    p.add_argument("--max-running", type=int, default=0, help="0: the engine's default for its device")
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument(
        "--host-kv-gb", type=float, default=-1.0, help="the host KV tier of every policy (-1: twice the cut pool)"
    )
    p.add_argument("--ttft-s", type=float, default=1.0)
    p.add_argument("--itl-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=46)
    p.add_argument(
        "--repeat-full",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run full reservation twice: the tokens two runs of one policy differ by (default: on a GPU)",
    )
    p.add_argument(
        "--policies", default="", help=f"comma-separated, run in this order, of {','.join(POLICIES)} (default: all)"
    )
    p.add_argument("--out", default=str(OUT_DIR / "pool_bound.json"))
    args = p.parse_args()

    from common.config import WorkerConfig
    from common.default_model import resolve_model_path
    from common.engine.runner import ModelRunner

    threads = int(os.environ.get("KVFERRY_TORCH_THREADS", "0") or 0)
    if threads:
        torch.set_num_threads(threads)
    # dummy:<name> is a named shape with random weights (ModelRunner builds it); anything else is a path or name.
    is_dir = args.model.startswith("dummy:") or Path(args.model).exists()
    path = args.model if is_dir else str(resolve_model_path(args.model))
    # The worker's own settings (KVFERRY_DEVICE, dtype, ...) so a GPU run sizes its pool as a pod would.
    rcfg = WorkerConfig.from_env("decode").runner
    rcfg.model = path
    if args.max_running:
        rcfg.max_running = args.max_running
    runner = ModelRunner(rcfg)
    if args.prompt_tokens[1] + args.max_tokens > runner.max_seq_len:
        raise SystemExit(f"prompt + max_tokens exceeds the context ({runner.max_seq_len}): set KVFERRY_MAX_SEQ_LEN")
    default_pages = runner.pool.num_pages
    pages = args.pool_pages or max(1, int(default_pages * args.pool_fraction))
    # The allocator's range is cut to `pages` (the pool's memory stays: nothing is reallocated).
    runner.pool.num_pages = min(pages, default_pages)
    need = -(-(args.prompt_tokens[1] + args.max_tokens) // runner.cfg.page_size)
    if need > runner.pool.num_pages:
        raise SystemExit(f"a request may need {need} pages, more than the pool's {runner.pool.num_pages}")
    if args.host_kv_gb < 0:
        args.host_kv_gb = 2 * runner.pool.num_pages * runner.pool.page_stride_bytes / (1 << 30)
    work = workload(args, runner.model_config.vocab_size)
    if args.repeat_full is None:
        args.repeat_full = runner.device.type == "cuda"
    print(
        f"{args.requests} requests, prompts {args.prompt_tokens}, outputs {args.output_tokens} of max_tokens "
        f"{args.max_tokens}; pool {runner.pool.num_pages} pages of {runner.cfg.page_size} "
        f"({default_pages} by default), host tier {args.host_kv_gb:.3g} GiB, max_running {runner.cfg.max_running}, "
        f"device {runner.device}",
        flush=True,
    )
    results = {}
    # On a GPU a request's greedy tokens depend on the batch it ran in (kernels pick tiles by batch size, bf16
    # sums in another order), and two runs of one policy batch differently: full reservation runs twice, and
    # what differs between those two runs is the floor against which the other policies' differences are read.
    names = ["full", "full_again"] if args.repeat_full else ["full"]
    names += ["optimistic", "optimistic_park"] if args.host_kv_gb > 0 else ["optimistic"]
    if args.policies:  # in the order given (on a shared box, swapping the order shows what the load did)
        names = args.policies.split(",")
        unknown = [n for n in names if n not in POLICIES]
        if unknown:
            raise SystemExit(f"unknown policies {unknown}: choose from {list(POLICIES)}")
    for name in names:
        r = results[name] = run_policy(runner, name, work, args)
        gc.collect()  # the run's scheduler and its host tier go before the next one is built
        print(
            f"{name:>15}: admitted peak {r['peak_admitted']} mean {r['mean_admitted']}, goodput "
            f"{r['goodput_rps']} req/s ({r['good_requests']}/{args.requests} good), {r['output_tokens_per_s']} "
            f"out tok/s, TTFT p50 {r['ttft_p50_s']} s, {r['preemptions']} preemptions ({r['preemptions_parked']} "
            f"parked, {r['recomputed_tokens']} tokens recomputed), {r['steps']} steps, {r['elapsed_s']} s "
            f"({r['cpu_s']} s of CPU)",
            flush=True,
        )
    ref = results[names[0]]  # full reservation unless --policies leaves it out
    same = all(r["outputs"] == ref["outputs"] for r in results.values())
    differ = {}
    for name in names[1:]:
        r = results[name]
        differ[f"{name}_vs_{names[0]}"] = differing(ref["outputs"], r["outputs"])
        if r["preempted_ids"]:
            only = r["preempted_ids"]
            differ[f"{name}_preempted_vs_{names[0]}"] = differing(ref["outputs"], r["outputs"], only=only)

    def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
        return {
            "mean_admitted": round(a["mean_admitted"] / max(b["mean_admitted"], 1e-9), 3),
            "peak_admitted": round(a["peak_admitted"] / max(b["peak_admitted"], 1), 3),
            "goodput": round(a["goodput_rps"] / b["goodput_rps"], 3) if b["goodput_rps"] else None,
            "output_tokens_per_s": round(a["output_tokens_per_s"] / max(b["output_tokens_per_s"], 1e-9), 3),
        }

    compared = {}
    if "optimistic" in results and "full" in results:
        compared["optimistic_over_full"] = ratios(results["optimistic"], results["full"])
    if "optimistic_park" in results and "optimistic" in results:
        compared["park_over_recompute"] = ratios(results["optimistic_park"], results["optimistic"])
    for what, r in compared.items():
        print(f"{what}: {r}", flush=True)
    print(f"outputs equal: {same}; requests whose tokens differ: {differ}", flush=True)
    lost = [
        n for n, r in results.items() if len(r["outputs"]) != args.requests or any(not v for v in r["outputs"].values())
    ]
    for r in results.values():
        r.pop("outputs")
    report = {
        "args": {k: v for k, v in vars(args).items()},
        "pool_pages": runner.pool.num_pages,
        "default_pool_pages": default_pages,
        "device": str(runner.device),
        "host": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "machine": platform.machine()},
        "results": results,
        **compared,
        "outputs_equal": same,
        "requests_differing": differ,
        "policies_losing_requests": lost,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    # Equal tokens are the claim where kernels do not depend on the batch (the CPU); elsewhere, every request
    # answered and the page ledger clean in every run.
    exact = runner.device.type == "cpu"
    ok = (same or not exact) and not lost and not any(r["ledger_violations"] for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
