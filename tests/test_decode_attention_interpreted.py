"""The split-KV decode attention kernel (common/engine/gpu/decode_attention.py) on the CPU under Triton's
interpreter: 16-bit-style and FP8 pages with their K/V scales, one split (the direct store, no merge) and
several (the merge), against float64 attention. The GPU runs the same at bfloat16 in tests/test_gpu_kernels.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_decode_attention_interpreted_matches_float64() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.decode_attention_interpreted"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])["cases"]
    assert {c["pages"] for c in cases} == {"torch.float32", "torch.float8_e4m3fn"}
    assert {c["splits"] for c in cases} == {1, 3}
    assert all(c["rel_err"] < 1e-5 for c in cases), cases
