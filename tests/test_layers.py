"""The layer rules of docs/architecture.md hold: import-linter's contracts (pyproject.toml) are kept, and the
router process runs without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def test_import_contracts_are_kept() -> None:
    # A fresh process from the repository root: grimp finds the packages on its own sys.path.
    done = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


ROUTER_PROBE = """
import json, sys
from common.config import RouterConfig
from router.app import create_app
imported = "torch" in sys.modules
if sys.argv[2] == "build":
    create_app(RouterConfig(model=sys.argv[1], discovery="static", decode_urls=["http://127.0.0.1:9"]), use_redis=False)
print(json.dumps("torch" in sys.modules))
"""


def _router_loads_torch(smol_path: Path, stage: str) -> bool:
    done = subprocess.run(
        [sys.executable, "-c", ROUTER_PROBE, str(smol_path), stage],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_router_import_loads_no_torch(smol_path) -> None:
    """The router's modules (settings, routing, prefix reader) reach no engine code: its memory and start
    time are its own, not the engine's."""
    assert not _router_loads_torch(smol_path, "import")


def test_router_app_build_loads_no_torch(smol_path) -> None:
    """Building the router's app (tokenizer and chat template included) leaves torch unloaded too."""
    assert not _router_loads_torch(smol_path, "build")
