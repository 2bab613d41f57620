"""The prefill worker: prefill routes (common/serving/prefill_routes.py) over a prefill engine loop."""

from __future__ import annotations

from fastapi import FastAPI

from common.config import WorkerConfig
from common.serving.control import WorkerState, create_worker_app
from common.serving.engine_host import engine_main
from common.serving.prefill_host import PrefillHost
from common.serving.prefill_routes import add_prefill_routes
from common.settings import HttpLimits


def create_app(cfg: WorkerConfig | None = None, http_limits: HttpLimits | None = None) -> FastAPI:
    """``http_limits`` default to ``HttpLimits.from_env()`` (KVFERRY_HTTP_*)."""
    cfg = cfg or WorkerConfig.from_env("prefill")
    return create_worker_app(WorkerState(cfg, engine_main, PrefillHost), add_prefill_routes, http_limits)
