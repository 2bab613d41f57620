"""What a mixed step costs on the GPU: decode rows plus a prompt chunk in one forward, against a decode step.

    python bench/mixed_step.py --model dummy:llama-3.1-8b            # H200: step table + offline A/B
    python bench/mixed_step.py --model dummy:llama-3.1-8b --no-offline --batches 8,64

1. Step table (device time, CUDA events, median of `--iters`): a decode step of B requests with `--context`
   tokens of KV each (CUDA graph), a prefill-only step of a c-token chunk, and a mixed step (the B decode rows
   as one-token extends + the chunk, flashinfer's batched prefill), the last two as piecewise CUDA graphs (the
   default) and eager (`*_eager_ms`, the graphs switched off in the same process). Per (B, c): mixed / decode, and the chunk's
   marginal speed c / (mixed - decode) against the prefill-only speed: the auto ITL target (2 decode steps)
   leaves room for the chunk whose mixed step is 2x the decode step.
2. Offline A/B (`--offline`): one engine, the serving workload's shape (prompts 512-3072, outputs 64-512, all
   submitted at once), prefill-first (ITL target 0) against the default (auto): output tok/s and their ratio.

Writes bench/out/mixed_step_<device>.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.roofline import device_ms, log  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent / "out"


def timed_both(runner, fb, iters: int) -> tuple[float, float]:
    """Device ms of one step through the piecewise step graphs and eagerly (same runner, same batch)."""
    graphed = device_ms(lambda: runner.forward(fb), iters)
    steps, runner.gpu.step_graphs = runner.gpu.step_graphs, None
    try:
        eager = device_ms(lambda: runner.forward(fb), iters)
    finally:
        runner.gpu.step_graphs = steps
    return graphed, eager


def step_table(runner, batches: list[int], chunks: list[int], context: int, iters: int) -> list[dict]:
    pt = runner.page_table
    ps = runner.cfg.page_size
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    max_b = max(batches)
    lens = [context] * max_b + [max(chunks)]
    rows, taken = [], 0
    for n in lens:
        row = pt.take_row()
        k = -(-n // ps)
        pt.write_pages(row, 0, torch.arange(taken, taken + k))
        taken += k
        rows.append(row)
    out = []
    try:
        seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
        # The decode rows' KV (all but the last position), once.
        for i in range(0, max_b, 16):
            part = list(range(i, min(i + 16, max_b)))
            fb = runner.build_batch(
                [seqs[j][:-1] for j in part], [0] * len(part), [rows[j] for j in part], [False] * len(part), False
            )
            runner.forward(fb)
        new_row, new = rows[-1], seqs[-1]
        prefill, prefill_eager = {}, {}
        for c in chunks:
            fb = runner.build_batch([new[:c]], [0], [new_row], [True], False)
            prefill[c], prefill_eager[c] = timed_both(runner, fb, iters)
            log(
                f"prefill-only chunk {c}: {prefill[c]:.2f} ms ({c / prefill[c] * 1e3:.0f} tok/s), "
                f"eager {prefill_eager[c]:.2f} ms"
            )
        for b in batches:
            ids = [[seqs[j][-1]] for j in range(b)]
            pos = [context - 1] * b
            fb = runner.build_batch(ids, pos, rows[:b], [True] * b, True)
            dec = device_ms(lambda fb=fb: runner.forward(fb), iters)
            log(f"decode B={b}: {dec:.2f} ms")
            for c in chunks:
                fb = runner.build_batch([*ids, new[:c]], [*pos, 0], [*rows[:b], new_row], [True] * (b + 1), False)
                mixed, mixed_eager = timed_both(runner, fb, iters)
                extra = mixed - dec
                r = dict(
                    batch=b,
                    chunk=c,
                    decode_ms=round(dec, 3),
                    mixed_ms=round(mixed, 3),
                    mixed_eager_ms=round(mixed_eager, 3),
                    prefill_only_ms=round(prefill[c], 3),
                    prefill_only_eager_ms=round(prefill_eager[c], 3),
                    mixed_over_decode=round(mixed / dec, 3),
                    chunk_marginal_tok_per_s=round(c / extra * 1e3) if extra > 0 else None,
                    prefill_only_tok_per_s=round(c / prefill[c] * 1e3),
                    separate_over_mixed=round((dec + prefill[c]) / mixed, 3),
                )
                out.append(r)
                log(
                    f"  mixed B={b} c={c}: {mixed:.2f} ms = {r['mixed_over_decode']:.2f}x decode (eager "
                    f"{mixed_eager:.2f} ms); separate steps {dec + prefill[c]:.2f} ms ({r['separate_over_mixed']:.2f}x)"
                )
    finally:
        for row in rows:
            pt.give_row(row)
    return out


def offline(runner, n: int, target_ms: float, seed: int) -> dict:
    from common.protocol import SamplingParams
    from common.sched.request import Req
    from common.sched.scheduler import Scheduler
    from common.settings import SchedulerConfig

    g = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    ins = torch.randint(512, 3073, (n,), generator=g).tolist()
    outs = torch.randint(64, 513, (n,), generator=g).tolist()
    sched = Scheduler(runner, SchedulerConfig(itl_target_ms=target_ms, host_kv_gb=0))
    reqs = [
        Req(f"r{i}", torch.randint(0, vocab, (m,), generator=g).tolist(), SamplingParams(max_tokens=o, ignore_eos=True))
        for i, (m, o) in enumerate(zip(ins, outs))
    ]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for r in reqs:
        sched.add(r)
    kinds: dict[str, int] = {}
    while sched.has_work():
        sched.step()
        kinds[sched.processed_kind or "none"] = kinds.get(sched.processed_kind or "none", 0) + 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    assert all(len(r.output_ids) == o for r, o in zip(reqs, outs))
    return dict(
        itl_target_ms=target_ms,
        requests=n,
        wall_s=round(wall, 2),
        output_tok_per_s=round(sum(outs) / wall, 1),
        step_kinds=kinds,
        itl_target_s=round(sched.pacing.itl_target_s(), 5),
        chunk_beside_decoding=sched.prefill_token_budget(decoding=True),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--chunks", default="64,128,256,512,1024,2048")
    p.add_argument("--context", type=int, default=1536)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--kv-gb", type=float, default=60.0)
    p.add_argument("--offline-requests", type=int, default=200)
    p.add_argument("--no-offline", action="store_true")
    p.add_argument(
        "--split-min-rows",
        default="",
        help="comma list: the step table again per value of attention.SPLIT_DECODE_MIN_ROWS (decode rows that "
        "take the decode kernel in a mixed step)",
    )
    p.add_argument("--out")
    args = p.parse_args()

    from common.engine.runner import ModelRunner
    from common.settings import ITL_TARGET_AUTO, RunnerConfig

    t0 = time.perf_counter()
    runner = ModelRunner(
        RunnerConfig(model=args.model, device="cuda", kv_memory_gb=args.kv_gb, max_running=256, cuda_graph_max_bs=128)
    )
    log(f"runner ready in {time.perf_counter() - t0:.0f} s ({runner.backend})")
    result: dict = {"args": vars(args), "device": torch.cuda.get_device_name()}
    out = Path(args.out) if args.out else OUT_DIR / f"mixed_step_{torch.cuda.get_device_name().split()[-1]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    batches = [int(x) for x in args.batches.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    result["steps"] = step_table(runner, batches, chunks, args.context, args.iters)
    out.write_text(json.dumps(result, indent=1))
    if args.split_min_rows:
        from common.engine.gpu import attention

        landed = attention.SPLIT_DECODE_MIN_ROWS
        result["split_min_rows"] = {}
        for n in (int(x) for x in args.split_min_rows.split(",")):
            attention.SPLIT_DECODE_MIN_ROWS = n
            log(f"step table with SPLIT_DECODE_MIN_ROWS={n}")
            result["split_min_rows"][n] = step_table(runner, batches, chunks, args.context, args.iters)
            out.write_text(json.dumps(result, indent=1))
        attention.SPLIT_DECODE_MIN_ROWS = landed
    if not args.no_offline:
        offline(runner, 16, ITL_TARGET_AUTO, seed=99)  # warm-up: lazy inits, the kernels of odd shapes
        result["offline"] = []
        steps = runner.gpu.step_graphs
        for target, graphed in ((0.0, True), (ITL_TARGET_AUTO, True), (ITL_TARGET_AUTO, False)):
            runner.gpu.step_graphs = steps if graphed else None
            r = offline(runner, args.offline_requests, target, seed=1)
            r["step_graphs"] = graphed
            result["offline"].append(r)
            log(
                f"offline ITL target {target}, step graphs {graphed}: {r['output_tok_per_s']:.0f} output tok/s, "
                f"steps {r['step_kinds']}"
            )
            out.write_text(json.dumps(result, indent=1))
        runner.gpu.step_graphs = steps
        a, b, c = result["offline"]
        result["offline_auto_over_prefill_first"] = round(b["output_tok_per_s"] / a["output_tok_per_s"], 3)
        result["offline_auto_eager_over_prefill_first"] = round(c["output_tok_per_s"] / a["output_tok_per_s"], 3)
        log(
            f"offline throughput / prefill-first: auto {result['offline_auto_over_prefill_first']:.3f}, "
            f"auto without step graphs {result['offline_auto_eager_over_prefill_first']:.3f}"
        )
    out.write_text(json.dumps(result, indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
