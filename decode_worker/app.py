"""The decode worker: its routes (decode_worker/routes.py) over an engine with the decode role
(decode_worker/engine.py)."""

from __future__ import annotations

from fastapi import FastAPI

from common.config import WorkerConfig
from common.worker.control import create_worker_app
from common.worker.engine_host import engine_main
from common.worker.worker_state import WorkerState
from decode_worker.engine import DecodeRole
from decode_worker.routes import add_decode_routes


def create_app(cfg: WorkerConfig | None = None) -> FastAPI:
    cfg = cfg or WorkerConfig.from_env("decode")
    return create_worker_app(WorkerState(cfg, engine_main, (DecodeRole,)), add_decode_routes)
