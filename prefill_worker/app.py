"""The prefill worker: its routes (prefill_worker/routes.py) over an engine with the prefill role
(prefill_worker/engine.py)."""

from __future__ import annotations

from fastapi import FastAPI

from common.config import WorkerConfig
from common.settings import HttpLimits
from common.worker.control import create_worker_app
from common.worker.engine_host import engine_main
from common.worker.worker_state import WorkerState
from prefill_worker.engine import PrefillRole
from prefill_worker.routes import add_prefill_routes


def create_app(cfg: WorkerConfig | None = None, http_limits: HttpLimits | None = None) -> FastAPI:
    """``http_limits`` default to ``HttpLimits.from_env()`` (KVFERRY_HTTP_*)."""
    cfg = cfg or WorkerConfig.from_env("prefill")
    return create_worker_app(WorkerState(cfg, engine_main, (PrefillRole,)), add_prefill_routes, http_limits)
