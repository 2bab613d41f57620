"""The GPU's two-launch argmax (common/engine/gpu/argmax.py, greedy sampling) on the CPU under Triton's interpreter,
against torch's argmax. tests/test_gpu_kernels.py runs it on the GPU at a 128k vocabulary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_two_launch_argmax_interpreted_matches_torch() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.argmax_interpreted"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    *rows, nan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 4 and all(c["dtype"] == "int64" for c in rows), rows
    assert all(c["same"] and c["bf16_same"] for c in rows), rows
    assert nan["nan_row"] == nan["nan_id"], nan
