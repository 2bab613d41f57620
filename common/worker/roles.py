"""The worker roles, in one table: which pod packages' plug-ins each role is made of.

A pod package (prefill_worker/, decode_worker/) adds two things to the worker process: its part of the engine
(an ``EngineRole``, built in the engine process) and its HTTP routes. A mixed worker is both plug-ins over one
engine. The pod packages sit above common (they import it), so the table names their modules and they are
imported on use, as the `kvferry` commands are (common/cli.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from common.worker.worker_state import WorkerState

__all__ = ["ROLE_TABLE", "RolePlugin", "plugins"]


@dataclass(frozen=True)
class RolePlugin:
    """What one pod package adds to a worker: ``engine`` names (``module:class``) what builds its part of the engine
    (common/worker/commands.py ``EngineRole``), imported in the engine process only (common/worker/engine_entry.py:
    the control plane never loads the engine's modules, torch among them); ``add_routes`` adds its HTTP routes to
    the control plane."""

    engine: str
    add_routes: Callable[[FastAPI, WorkerState], None]


# role -> the modules whose ``PLUGIN`` make it. Order matters: the first engine role holding a request is the
# one that aborts it (a mixed worker's prefill role its peers' requests, the decode role the rest).
ROLE_TABLE: dict[str, tuple[str, ...]] = {
    "prefill": ("prefill_worker.role",),
    "decode": ("decode_worker.role",),
    "mixed": ("prefill_worker.role", "decode_worker.role"),
}


def plugins(role: str) -> tuple[RolePlugin, ...]:
    if role not in ROLE_TABLE:
        raise ValueError(f"unknown worker role {role!r} (one of {', '.join(ROLE_TABLE)})")
    return tuple(importlib.import_module(name).PLUGIN for name in ROLE_TABLE[role])
