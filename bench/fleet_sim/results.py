"""Where a simulator script's results go: one JSON, with the seconds the run took, and the line that says so."""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["save_results"]


def save_results(path: Path, out: dict, started: float) -> None:
    """Writes `out` to `path` (its folders made) with ``seconds`` since `started` (``time.perf_counter``)."""
    out["seconds"] = time.perf_counter() - started
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"-> {path} ({out['seconds']:.0f} s)")
