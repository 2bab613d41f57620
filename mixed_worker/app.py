"""`kvferry mixed`: a decode worker that also prefills for peers (common/serving/mixed_host.py).

It serves the decode routes (`/internal/generate`, local or remote prefill) and the prefill routes
(`/internal/handshake`, `/internal/prefill`, `/internal/agent`, `/internal/stats`) over one engine, so the
router can place each request aggregated on it, disaggregated from it to another decode-capable pod, or
disaggregated into it from a prefill-capable one.
"""

from __future__ import annotations

from fastapi import FastAPI

from common.config import WorkerConfig, worker_arg_parser
from common.serving.control import WorkerState, create_worker_app, serve_worker
from common.serving.decode_routes import add_decode_routes
from common.serving.engine_host import engine_main
from common.serving.mixed_host import MixedHost
from common.serving.prefill_routes import add_prefill_routes


def create_app(cfg: WorkerConfig | None = None) -> FastAPI:
    cfg = cfg or WorkerConfig.from_env("mixed")

    def add_routes(app: FastAPI, state: WorkerState) -> None:
        add_decode_routes(app, state)
        add_prefill_routes(app, state, abort_route=False)

    return create_worker_app(WorkerState(cfg, engine_main, MixedHost), add_routes)


def main(argv: list[str] | None = None) -> int:
    args = worker_arg_parser("mixed").parse_args(argv)
    cfg = WorkerConfig.from_env("mixed").apply_args(args)
    app = create_app(cfg)
    return serve_worker(app, app.state.worker)
