"""bench/step_trace_margin.py: the scheduler's step model replayed over a step trace says how much of the chunk
steps' tail its margin covers."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "bench"))

from step_trace_margin import replay  # noqa: E402


def _trace(path: Path, chunk_noise_s: float) -> Path:
    """Steps of 5 ms + 20 us a decode row + 20 us a prompt token, each give or take 1 ms and the chunk steps
    `chunk_noise_s` more (uniform): a trace as KVFERRY_STEP_TRACE writes it."""
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(3000):
            rows = rng.randint(1, 64)
            if i % 4 == 0:
                tokens = rng.choice((512, 1024, 2048))
                s = 0.005 + 20e-6 * (rows + tokens) + rng.uniform(-chunk_noise_s - 0.001, chunk_noise_s + 0.001)
                kind, attention = "mixed", tokens * tokens / 2
            else:
                tokens, s, kind, attention = 0, 0.005 + 20e-6 * rows + rng.uniform(-0.001, 0.001), "decode", 0.0
            step = {"kind": kind, "prefill_tokens": tokens, "decode_rows": rows, "decode_context": rows * 1000}
            f.write(json.dumps(step | {"chunk_attention": attention, "device_s": s, "gap_s": s}) + "\n")
    return path


def test_a_chunk_tail_wider_than_the_decode_steps_shows_past_the_margin(tmp_path: Path) -> None:
    quiet = replay(_trace(tmp_path / "quiet.jsonl", 0.0))
    noisy = replay(_trace(tmp_path / "noisy.jsonl", 0.008))
    assert quiet["chunk_steps"] > 500 and quiet["over_margin_share"] <= quiet["aimed_share"]
    # chunk steps +-9 ms: RMS 5.2 ms on a quarter of the steps, so the window's spread is about half of that
    assert 4.5 < noisy["residual_rms_ms"] < 6.0 and noisy["model_spread_p50_ms"] < 0.7 * noisy["residual_rms_ms"]
    assert noisy["over_margin_share"] > 5 * noisy["aimed_share"]
