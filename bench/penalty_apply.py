"""The cost of one step's penalties alone: sparse (at each row's history ids) against the dense passes.

    python bench/penalty_apply.py                     # CPU: batch 128, vocab 49,152 and 128,256, history 300 and 1,500
    python bench/penalty_apply.py --device cuda

Each row has frequency 0.5, presence 0.3 and repetition 1.1 penalties and a history of `--histories` tokens
(three quarters prompt, a quarter output, ids drawn uniformly). Timed per step: reading the batch's penalty
state, penalising the logits, and counting the step's sampled tokens. `sparse` is the code the scheduler
runs (common/sched/penalties.py and common/engine/sampling.py): the batch's history window and the counts
at its ids, the dense formula's float32 operations on those logits only, a scatter back into the logits,
the tokens appended and counted. `dense` is what it replaced, kept here as the baseline: [rows, V] output
counts and prompt bits gathered whole, the repetition and frequency/presence formulas as elementwise passes
over [batch, vocab] float32 tensors. Both give the same logits bit for bit (checked each case). Also counted
under torch.profiler: the ops each issues per step and how many of them pass over a whole [batch, vocab]
tensor (gathers, scatters and index writes touch only the elements they index). The best of `--repeats`
steps counts (the median is kept too); the ratio dense / sparse is printed per case. Writes
`bench/out/penalty_apply_<device>.json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

OUT_DIR = Path(__file__).resolve().parent / "out"
PENALTIES = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)


class Dense:
    """The replaced dense path: [rows, V] counts and prompt bits, whole-vocabulary passes."""

    def __init__(self, prompts: torch.Tensor, outputs: torch.Tensor, vocab: int) -> None:
        rows = prompts.shape[0]
        self.counts = torch.zeros(rows, vocab, dtype=torch.float32, device=prompts.device)
        self.counts.scatter_add_(1, outputs, torch.ones(outputs.shape, device=prompts.device))
        self.in_prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=prompts.device)
        self.in_prompt.scatter_(1, prompts, True)

    def step(self, logits: torch.Tensor, sb, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        counts = self.counts.index_select(0, rows)
        seen = self.in_prompt.index_select(0, rows) | (counts > 0)
        p = sb.repetition_penalty[:, None]
        penalized = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalized, logits)
        logits = logits - sb.frequency_penalty[:, None] * counts - sb.presence_penalty[:, None] * (counts > 0)
        ones = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
        self.counts.index_put_((rows, tokens), ones, accumulate=True)
        return logits


class Sparse:
    """The scheduler's path, on a batch whose rows are its table rows 0..B-1."""

    def __init__(self, prompts: torch.Tensor, outputs: torch.Tensor, vocab: int) -> None:
        from common.sched.penalties import PenaltyBatch, PenaltyHistory

        rows, cut = prompts.shape
        device = prompts.device
        self.state = PenaltyHistory(rows, vocab, device)
        length = cut + outputs.shape[1]
        self.state._reserve(length + 1)
        assert self.state.ids is not None and self.state.counts is not None
        self.state.ids[:, :length] = torch.cat([prompts, outputs], dim=1)
        self.state.ids[:, length:] = prompts[:, :1]
        self.state.counts.scatter_add_(1, outputs, torch.ones(outputs.shape, device=device))
        rows_dev = torch.arange(rows, device=device)
        self.batch = PenaltyBatch(
            rows_dev=rows_dev,
            start=torch.full((rows,), cut, dtype=torch.int64, device=device),
            count_index=rows_dev * vocab,
            ones=torch.ones(rows, dtype=torch.float32, device=device),
            width=length,
            step=outputs.shape[1],
        )
        self.steps = [outputs.shape[1]] * rows
        self.steps_dev = torch.tensor(self.steps, device=device)

    def step(self, logits: torch.Tensor, sb, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        from common.engine.sampling import adjust_logits

        sb.history = self.state.view(self.batch, self.steps, True)
        logits = adjust_logits(logits, sb)
        self.state.record(self.batch, self.steps_dev, tokens)
        return logits


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# Ops that read or write only the elements their indices name, whatever the size of the tensor they index.
INDEXED = {
    "aten::gather",
    "aten::scatter",
    "aten::scatter_",
    "aten::take",
    "aten::index_put_",
    "aten::index_add_",
    "aten::index",
}
VIEWS = {"aten::slice", "aten::view", "aten::unsqueeze", "aten::expand", "aten::select", "aten::narrow"}


def _ops(step: Callable[..., object], args: tuple, full: int) -> dict:
    """One step's ops (top-level aten ops under torch.profiler, views left out: they launch nothing), and how
    many of them pass over a whole [batch, vocab] tensor: not an indexed op, an input of `full` elements or
    more."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(*args)
    top = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None and e.name not in VIEWS]
    wide = [e for e in top if e.name not in INDEXED and any(_numel(s) >= full for s in e.input_shapes)]
    return {"ops": len(top), "full_vocab_ops": len(wide), "op_names": [e.name for e in top]}


def _numel(shape: object) -> int:
    if not isinstance(shape, list) or not shape or not all(isinstance(d, int) for d in shape):
        return 0
    n = 1
    for d in shape:
        n *= d
    return n


def run_case(device: torch.device, batch: int, vocab: int, history: int, repeats: int) -> dict:
    from common.engine.sampling import SamplingBatch
    from common.protocol import SamplingParams

    gen = torch.Generator().manual_seed(batch + vocab + history)
    cut = history * 3 // 4
    prompts = torch.randint(0, vocab, (batch, cut), generator=gen).to(device)
    outputs = torch.randint(0, vocab, (batch, history - cut), generator=gen).to(device)
    logits = (torch.randn(batch, vocab, generator=gen) * 4).to(device)
    tokens = torch.randint(0, vocab, (batch,), generator=gen).to(device)
    rows = torch.arange(batch, device=device)
    params = [SamplingParams(**PENALTIES)] * batch
    sb = SamplingBatch.build(params, [0] * batch, vocab, device, [history - cut] * batch, [[0]] * batch)

    out: dict = {"batch": batch, "vocab": vocab, "history": history}
    results = {}
    for name, cls in (("dense", Dense), ("sparse", Sparse)):
        path = cls(prompts, outputs, vocab)
        results[name] = path.step(logits.clone(), sb, rows, tokens)
        seconds = []
        for _ in range(repeats):
            x = logits.clone()
            _sync(device)
            t = time.perf_counter()
            path.step(x, sb, rows, tokens)
            _sync(device)
            seconds.append(time.perf_counter() - t)
        out[name] = {
            "median_ms": round(1e3 * statistics.median(seconds), 4),
            "best_ms": round(1e3 * min(seconds), 4),
            **_ops(path.step, (logits.clone(), sb, rows, tokens), batch * vocab),
        }
    out["identical"] = bool(torch.equal(results["dense"], results["sparse"]))
    out["dense_over_sparse"] = round(out["dense"]["best_ms"] / out["sparse"]["best_ms"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--vocabs", default="49152,128256")
    ap.add_argument("--histories", default="300,1500")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default="", help="JSON path (default bench/out/penalty_apply_<device>.json)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cases = []
    with torch.inference_mode():
        for vocab in (int(v) for v in args.vocabs.split(",")):
            for history in (int(h) for h in args.histories.split(",")):
                case = run_case(device, args.batch, vocab, history, args.repeats)
                cases.append(case)
                print(
                    f"batch {case['batch']} vocab {vocab:>7,} history {history:>5}: "
                    f"dense {case['dense']['best_ms']:8.3f} ms ({case['dense']['ops']} ops, "
                    f"{case['dense']['full_vocab_ops']} over [batch, vocab]) | sparse {case['sparse']['best_ms']:8.3f} ms "
                    f"({case['sparse']['ops']} ops, {case['sparse']['full_vocab_ops']} over [batch, vocab]) | "
                    f"dense/sparse {case['dense_over_sparse']}x | identical {case['identical']}",
                    flush=True,
                )
    report = {
        "device": str(device),
        "host": platform.node(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cases": cases,
    }
    path = Path(args.out) if args.out else OUT_DIR / f"penalty_apply_{device.type}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
