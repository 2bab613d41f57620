"""The engine process's entry as the control plane names it (its spawn target). Importing this module loads
nothing of the engine, and the roles' engine parts come as names: the control plane starts the engine process
without importing torch and the engine's modules itself first (the engine process imports them anyway; serially
before the spawn they only delayed the engine's start, and held the control plane's memory).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config import WorkerConfig


def resolve(name: str) -> type:
    """``module:attribute`` -> the attribute (a role's ``EngineRole`` class, common/worker/roles.py)."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def engine_process(roles: Sequence[str], cfg: WorkerConfig, conn: Connection, spawned_at: float | None = None) -> None:
    from common.worker.engine_loop import engine_main

    engine_main([resolve(name) for name in roles], cfg, conn, spawned_at)
