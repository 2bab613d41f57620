"""The decode worker: decode routes (common/serving/decode_routes.py) over a decode engine loop."""

from __future__ import annotations

from fastapi import FastAPI

from common.config import WorkerConfig
from common.serving.control import WorkerState, create_worker_app
from common.serving.decode_host import DecodeHost
from common.serving.decode_routes import add_decode_routes
from common.serving.engine_host import engine_main


def create_app(cfg: WorkerConfig | None = None) -> FastAPI:
    cfg = cfg or WorkerConfig.from_env("decode")
    return create_worker_app(WorkerState(cfg, engine_main, DecodeHost), add_decode_routes)
