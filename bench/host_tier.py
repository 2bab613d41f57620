"""The host-memory prefix tier under eviction pressure: TTFT and prefill work with the tier on vs off, one run.

    python bench/host_tier.py                                  # CPU: SmolLM2-135M, 24 docs x 384 tokens, 5 questions
    python bench/host_tier.py --docs 200 --doc-tokens 4096 --questions 5 --device cuda \\
        --model dummy:llama-3.1-8b --concurrency 16 --label h200   # the issue's GPU shape

Workload (seeded): `--docs` documents of `--doc-tokens` random token ids, `--questions` questions of
`--question-tokens` each; requests are document + question, interleaved (question 1 of every document, then
question 2 of every document, ...), so a document's next question comes after every other document has been
read: the worst case for an LRU cache smaller than the documents. Greedy, `--max-tokens` output tokens,
`--concurrency` requests in flight (closed loop: a new one starts when one finishes).

The device KV pool holds `--device-share` (default 10%) of the documents' pages (raised to what
`--concurrency` requests need at once); the host tier (on) holds them all with room to spare (`--host-gb`
to choose). Both runs use one model runner, a fresh scheduler each (empty caches), after a warm-up.

Measured per run: TTFT p50/p90 (request added -> first token, queueing included), prefill tokens computed
(prompt tokens not found in the cache), tokens loaded from the host tier, wall time, and whether the outputs
match between the runs. Ratios printed: prefill tokens on/off, TTFT off/on. JSON: bench/out/host_tier_<label>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common.engine.runner import ModelRunner
from common.kv.integrity import page_ledger_violations
from common.offline import Engine
from common.protocol import SamplingParams
from common.sched.request import Req
from common.settings import RunnerConfig, SchedulerConfig

OUT_DIR = Path(__file__).resolve().parent / "out"


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed)
    # Ids from the low vocabulary (ordinary tokens; special tokens sit at the ends of most vocabularies).
    top = min(vocab, 32000)
    docs = [torch.randint(100, top, (args.doc_tokens,), generator=gen).tolist() for _ in range(args.docs)]
    questions = [
        [torch.randint(100, top, (args.question_tokens,), generator=gen).tolist() for _ in range(args.docs)]
        for _ in range(args.questions)
    ]
    return [docs[d] + questions[q][d] for q in range(args.questions) for d in range(args.docs)]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _quantile(run: dict[str, Any], q: float, skip: int) -> float:
    """TTFT quantile over the requests after the first `skip` (the workload's first round: every document's
    first question, cold in any cache)."""
    xs = sorted(run["ttft_s"][skip:])
    return xs[int(q * (len(xs) - 1))] if xs else float("nan")


def drive(engine: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Closed loop over the scheduler: `concurrency` requests in flight, TTFT per request."""
    sched = engine.scheduler
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    queue = deque(enumerate(prompts))
    live: dict[str, tuple[int, Req, float]] = {}
    ttft: list[float] = [0.0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    computed = 0
    sync()
    t0 = time.perf_counter()
    while queue or sched.has_work():
        while queue and len(live) < concurrency:
            i, ids = queue.popleft()
            req = Req(uuid.uuid4().hex, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            sched.add(req)
            live[req.req_id] = (i, req, time.perf_counter())
        for ev in sched.step():
            i, req, added = live[ev.req.req_id]
            if ev.tokens and len(req.output_ids) == len(ev.tokens):  # its first token
                ttft[i] = time.perf_counter() - added
                computed += req.prompt_len - req.prefix_hit_len
            if ev.finished:
                outputs[i] = list(req.output_ids)
                del live[req.req_id]
    sync()
    wall = time.perf_counter() - t0
    cache = sched.cache
    assert cache is not None
    problems = page_ledger_violations(sched.allocator, cache, [])
    host = cache.host
    return {
        "wall_s": round(wall, 3),
        "ttft_p50_s": round(percentile(ttft, 0.5), 4),
        "ttft_p90_s": round(percentile(ttft, 0.9), 4),
        "ttft_mean_s": round(statistics.fmean(ttft), 4),
        "ttft_s": [round(t, 4) for t in ttft],
        "prefill_tokens_computed": computed,
        "prompt_tokens": sum(len(p) for p in prompts),
        "host_tokens_loaded": host.loaded_pages * engine.runner.cfg.page_size if host is not None else 0,
        "host_tokens_saved": host.saved_pages * engine.runner.cfg.page_size if host is not None else 0,
        "ledger_violations": problems,
        "outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--doc-tokens", type=int, default=384)
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--device-share", type=float, default=0.1, help="device pool / documents' pages")
    ap.add_argument("--host-gb", type=float, default=0.0, help="host tier size (0: every document, +25%%)")
    ap.add_argument("--max-prefill-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--plot-only", type=Path, default=None, help="only draw the plot of an earlier run's JSON")
    args = ap.parse_args()
    if args.plot_only is not None:
        plot(args.plot_only)
        return

    page = 16
    doc_pages = args.docs * -(-args.doc_tokens // page)
    per_request = -(-(args.doc_tokens + args.question_tokens + args.max_tokens) // page)
    device_pages = max(int(args.device_share * doc_pages), args.concurrency * per_request)
    runner = ModelRunner(
        RunnerConfig(
            model=args.model,
            device=args.device,
            page_size=page,
            num_pages=device_pages,
            max_running=max(args.concurrency, 4),
            max_seq_len=args.doc_tokens + args.question_tokens + args.max_tokens + page,
        )
    )
    page_bytes = runner.pool.page_stride_bytes
    host_gb = args.host_gb or 1.25 * (doc_pages + args.docs * args.questions) * page_bytes / (1 << 30)
    prompts = workload(args, runner.model_config.vocab_size)
    print(
        f"{len(prompts)} requests ({args.docs} docs x {args.questions} questions, {len(prompts[0])} tokens each); "
        f"device pool {device_pages} pages = {device_pages / doc_pages:.0%} of the documents' {doc_pages}; "
        f"host tier {host_gb:.3f} GiB = {int(host_gb * (1 << 30) // page_bytes)} pages",
        flush=True,
    )

    def engine(host: float) -> Engine:
        cfg = SchedulerConfig(max_prefill_tokens=args.max_prefill_tokens, host_kv_gb=host)
        return Engine(runner=runner, sched_cfg=cfg, load_tokenizer=False)

    drive(engine(0.0), prompts[: 2 * args.concurrency], args.concurrency, args.max_tokens)  # warm-up
    runs = {}
    for name, host in (("off", 0.0), ("on", host_gb)):
        runs[name] = drive(engine(host), prompts, args.concurrency, args.max_tokens)
        r = runs[name]
        print(
            f"tier {name:>3}: TTFT p50 {r['ttft_p50_s'] * 1e3:8.1f} ms  p90 {r['ttft_p90_s'] * 1e3:8.1f} ms  "
            f"prefill computed {r['prefill_tokens_computed']:>8} of {r['prompt_tokens']} tokens  "
            f"host loads {r['host_tokens_loaded']:>8} tokens  wall {r['wall_s']:.1f} s  "
            f"ledger {'ok' if not r['ledger_violations'] else r['ledger_violations']}",
            flush=True,
        )
    off, on = runs["off"], runs["on"]
    same = sum(a == b for a, b in zip(off["outputs"], on["outputs"], strict=True))
    ratios = {
        "prefill_tokens_on_over_off": round(on["prefill_tokens_computed"] / max(1, off["prefill_tokens_computed"]), 3),
        "ttft_p50_off_over_on": round(off["ttft_p50_s"] / on["ttft_p50_s"], 2),
        "ttft_p90_off_over_on": round(off["ttft_p90_s"] / on["ttft_p90_s"], 2),
        "wall_off_over_on": round(off["wall_s"] / on["wall_s"], 2),
        # The first question of each document is cold in both runs (1 / --questions of all requests, 20% at
        # 5): it bounds the overall p90. The repeat questions are what a tier can serve.
        "repeat_ttft_p50_off_over_on": round(_quantile(off, 0.5, args.docs) / _quantile(on, 0.5, args.docs), 2),
        "repeat_ttft_p90_off_over_on": round(_quantile(off, 0.9, args.docs) / _quantile(on, 0.9, args.docs), 2),
    }
    print(
        f"prefill tokens on/off {ratios['prefill_tokens_on_over_off']} (target <= 0.3), TTFT p50 off/on "
        f"{ratios['ttft_p50_off_over_on']}x, p90 off/on {ratios['ttft_p90_off_over_on']}x (target >= 3x); repeat "
        f"questions only: p50 {ratios['repeat_ttft_p50_off_over_on']}x, p90 {ratios['repeat_ttft_p90_off_over_on']}x; "
        f"outputs identical {same}/{len(prompts)}"
    )
    for r in runs.values():
        del r["outputs"]
    label = args.label or f"{args.device.split(':')[0]}_{args.model.replace(':', '-').replace('/', '_')}"
    out = OUT_DIR / f"host_tier_{label}.json"
    OUT_DIR.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "device_pages": device_pages,
                "doc_pages": doc_pages,
                "host_gb": host_gb,
                "runs": runs,
                "ratios": ratios,
                "outputs_identical": same,
                "requests": len(prompts),
                "machine": {
                    "platform": platform.platform(),
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                },
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    plot(out)


def plot(path: Path) -> None:
    """PNG beside the JSON: TTFT (CDF when the run kept every request's, else p50/p90) and prefill work, off vs on."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed")
        return
    result = json.loads(path.read_text())
    runs = result["runs"]
    fig, (ax_ttft, ax_work) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"off": "tab:red", "on": "tab:blue"}
    for name, r in runs.items():
        if r.get("ttft_s"):
            xs = sorted(r["ttft_s"])
            ax_ttft.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], color=colors[name], label=f"tier {name}")
        else:
            ax_ttft.barh(
                [f"{name} p50", f"{name} p90"],
                [r["ttft_p50_s"], r["ttft_p90_s"]],
                color=colors[name],
                label=f"tier {name}",
            )
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("TTFT (s)")
    ax_ttft.set_title("time to first token" + (" (CDF)" if any(r.get("ttft_s") for r in runs.values()) else ""))
    ax_ttft.legend()
    names = list(runs)
    computed = [runs[n]["prefill_tokens_computed"] for n in names]
    loaded = [runs[n]["host_tokens_loaded"] for n in names]
    ax_work.bar(names, computed, color=[colors[n] for n in names], label="prefill tokens computed")
    ax_work.bar(names, loaded, bottom=computed, color="tab:gray", alpha=0.5, label="tokens loaded from the host tier")
    ax_work.set_ylabel("tokens")
    ax_work.set_title(f"prefill work: on/off {result['ratios']['prefill_tokens_on_over_off']}")
    ax_work.legend()
    fig.suptitle(
        f"host KV tier, {result['requests']} requests, device pool {result['device_pages']} pages "
        f"({result['device_pages'] / result['doc_pages']:.0%} of the documents)"
    )
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
