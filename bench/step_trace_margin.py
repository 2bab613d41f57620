"""How much of the chunk steps' tail the scheduler's margin covers, replayed from engine step traces.

    python bench/step_trace_margin.py [TRACE.jsonl[.xz] ...] [--out bench/out/step_trace_margin.json]

A chunk step beside decoding is sized so that its predicted time plus `margin_z` residual spreads fits the ITL
target (common/sched/step_model.py `largest_chunk`). The spread is the fitted model's residual RMS over all the
steps in its window, most of them decode steps. This replays the engine's own `StepTimeModel` over a trace
(`KVFERRY_STEP_TRACE`, common/sched/step_trace.py), learning from each step by the engine's rule
(common/sched/itl_trim.py `learnt_step_s`). The trace's gap is the time a decoding stream saw since the step
before, where the engine learns from the back-to-back period: the two differ only after an idle engine.
At each chunk step it prints the share of chunk steps whose time exceeded the prediction by more than
`margin_z` spreads (the margin's own aim: 1 - 0.99). It also prints the chunk steps' residual RMS against the
model's spread. Default traces: the H200 run C of bench/RESULTS.md (bench/out/steps/).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.fleet_sim.workload import open_text  # noqa: E402
from common.sched.itl_trim import learnt_step_s  # noqa: E402
from common.sched.step_model import StepShape, StepTimeModel, z_score  # noqa: E402

DEFAULT_TRACES = [REPO / "bench" / "out" / "steps" / f"steps_{dtype}.jsonl.xz" for dtype in ("bf16", "fp8")]
PERCENTILE = 99.0  # the ITL target's percentile the margin holds (the default SLO's)


def chunk_steps(path: Path) -> Iterator[tuple[float, float, float]]:
    """Each chunk step beside decoding once the replayed model is ready: (its time, the model's prediction, the
    model's spread), both before the model learns from it."""
    model = StepTimeModel()
    with open_text(path) as f:
        for line in f:
            r = json.loads(line)
            shape = StepShape(r["prefill_tokens"], r["decode_rows"], r["decode_context"], r["chunk_attention"])
            took = learnt_step_s(r["gap_s"], r["device_s"])
            if r["kind"] == "mixed" and model.ready:
                yield took, model.predict(shape), model.spread_s
            model.observe(shape, took)


def replay(path: Path) -> dict[str, float]:
    """The replayed model's chunk-step residuals against its spread over one trace."""
    steps = np.array(list(chunk_steps(path)))
    res, spread = steps[:, 0] - steps[:, 1], steps[:, 2]
    z = z_score(PERCENTILE)
    return {
        "chunk_steps": int(res.size),
        "residual_p50_ms": float(np.percentile(res, 50) * 1e3),
        "residual_p99_ms": float(np.percentile(res, 99) * 1e3),
        "residual_rms_ms": float(np.sqrt(np.mean(res**2)) * 1e3),
        "model_spread_p50_ms": float(np.median(spread) * 1e3),
        "over_margin_share": float(np.mean(res > z * spread)),
        "aimed_share": 1 - PERCENTILE / 100,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "step_trace_margin.json")
    args = ap.parse_args()
    out = {}
    for path in args.traces:
        r = out[path.name] = replay(path)
        print(
            f"{path.name}: {r['chunk_steps']} chunk steps, residual RMS {r['residual_rms_ms']:.2f} ms against the "
            f"model's spread {r['model_spread_p50_ms']:.2f} ms (ratio {r['residual_rms_ms'] / r['model_spread_p50_ms']:.2f}); "
            f"over the margin {100 * r['over_margin_share']:.1f}% of chunk steps, aimed at {100 * r['aimed_share']:.1f}%",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
