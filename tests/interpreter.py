"""Runs a test script's kernels on the CPU under Triton's interpreter: in a subprocess, because TRITON_INTERPRET
is read when Triton is imported. The script prints one JSON line last, which `run_interpreted` returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(module: str) -> dict:
    """`python -m <module>` with TRITON_INTERPRET=1 (skipped without Triton); its last stdout line, parsed."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
