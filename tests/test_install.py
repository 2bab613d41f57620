"""`make setup` installs the torch build that fits the machine: a dry run of pip's resolver through the
Makefile's own `torch` target (nothing is installed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _has_gpu() -> bool:
    return (
        subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
        if shutil.which("nvidia-smi")
        else False
    )


def _resolve(tmp_path: Path, index: str) -> tuple[str, str]:
    """(the torch version pip would install, make's output)."""
    report = tmp_path / "report.json"
    args = f"--dry-run --ignore-installed --no-deps --report {report}"
    r = subprocess.run(
        [
            "make",
            "-s",
            "--no-print-directory",
            "torch",
            f"PYTHON={sys.executable}",
            f"TORCH_CPU_INDEX={index}",
            f"TORCH_PIP_ARGS={args}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["name"] == "torch"
    return item["metadata"]["version"], r.stdout + r.stderr


def _reachable(url: str) -> bool:
    try:
        return httpx.get(f"{url}/torch/", timeout=10, follow_redirects=True).status_code == 200
    except httpx.HTTPError:
        return False


def test_without_a_gpu_torch_is_the_cpu_build_or_the_fallback(tmp_path: Path) -> None:
    if _has_gpu():
        pytest.skip("a GPU machine installs the default (CUDA) build on purpose")
    version, out = _resolve(tmp_path, CPU_INDEX)
    assert version.startswith("2.13.0")
    # Where the index is out of reach pip still resolved above: the fallback to the default index, or pip's
    # own find-links, which it keeps using beside --index-url.
    if _reachable(CPU_INDEX):
        assert version.endswith("+cpu"), out  # the CPU index's build, not the default index's CUDA one


def test_an_unreachable_cpu_index_falls_back(tmp_path: Path) -> None:
    if _has_gpu():
        pytest.skip("a GPU machine never asks the CPU index")
    version, _ = _resolve(tmp_path, "http://127.0.0.1:9/simple")
    assert version.startswith("2.13.0")
