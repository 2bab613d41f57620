"""The `kvferry` command, run as a user would: a subprocess on the packaged default model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def kvferry(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kvferry")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "common.cli", *args]
    env = {**os.environ, "KVFERRY_LOG_LEVEL": "WARNING"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def _converted(smol_path):
    """Converts the default model once up front, so the subprocesses only load it."""
    return smol_path


def test_generate_prints_the_greedy_continuation():
    proc = kvferry("generate", "--max-tokens", "8", "The capital of France is")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(" Paris"), proc.stdout  # greedy by default: the continuation, not the prompt


def test_generate_stops_at_max_tokens():
    proc = kvferry("generate", "--max-tokens", "1", "The capital of France is")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == " Paris\n", repr(proc.stdout)  # one token, then the newline print adds


def test_generate_chat_answers_paris():
    proc = kvferry("generate", "--chat", "--max-tokens", "20", "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout, proc.stdout


COMMANDS = ("up", "router", "prefill", "decode", "mixed", "planner", "generate", "convert-default-model")


def test_usage_describes_each_command():
    """--help goes to stdout with exit 0; a missing or unknown command to stderr with exit 2; both list every
    command with a line saying what it does."""
    for args, code in (((), 2), (("--help",), 0), (("no-such-command",), 2)):
        proc = kvferry(*args, timeout=60)
        assert proc.returncode == code, (args, proc.returncode, proc.stderr)
        shown, silent = (proc.stdout, proc.stderr) if code == 0 else (proc.stderr, proc.stdout)
        assert silent == "", (args, silent)
        assert shown.startswith("usage: kvferry COMMAND"), (args, shown)
        for name in COMMANDS:
            (row,) = [line for line in shown.splitlines() if line.split()[:1] == [name]]
            assert len(row.split()) > 3, row  # the name, then what it does
