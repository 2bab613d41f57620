"""The layer rules of docs/architecture.md hold: import-linter's contracts (pyproject.toml) are kept, and the
router process runs without torch."""

from __future__ import annotations

import json
import re
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


ARCHITECTURE = ROOT / "docs" / "architecture.md"
NAMED_PATH = re.compile(
    r"(?<![\w/.-])((?:router|common|prefill_worker|decode_worker|mixed_worker|planner|bench|tests|k8s)/[\w./-]*\w/?)"
)


def test_architecture_names_only_existing_paths() -> None:
    """Every file and folder docs/architecture.md names (the package map, the request's path table, the
    settings table's modules) is in the tree: a moved or deleted file shows up here, not in a reader's walk."""
    named = set(NAMED_PATH.findall(ARCHITECTURE.read_text()))
    assert len(named) > 50, "the page's paths were not found: the pattern no longer matches them"
    # The layer diagram names modules without their `.py`.
    missing = sorted(p for p in named if not any((ROOT / f"{p.rstrip('/')}{end}").exists() for end in ("", ".py")))
    assert not missing, missing
