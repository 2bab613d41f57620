"""The GPU penalty kernels (common/engine/gpu/penalty.py) run on the CPU under Triton's interpreter and give the
torch path's logits bit for bit: every combination of repetition and frequency/presence penalties, windows of
one and of several blocks, repeated ids, and the record kernel over more rows than one program takes. The same
comparison on a GPU, at the 8B's vocabulary, is in tests/test_sampling.py (it needs CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_penalty_kernels_interpreted_equal_the_torch_path() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.penalty_kernels_interpreted"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = result["penalize"]
    assert {c["kind"] for c in cases} == {"all", "repetition only", "counts only"}
    assert any(c["width"] > 512 for c in cases)  # a window of several blocks
    assert all(c["equal"] for c in cases), cases
    assert result["record"]
