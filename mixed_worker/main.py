"""`kvferry mixed`: run a mixed worker (control plane here, engine in a child process)."""

from __future__ import annotations

from common.config import WorkerConfig, worker_arg_parser
from common.worker.control import serve_worker
from mixed_worker.app import create_app


def main(argv: list[str] | None = None) -> int:
    args = worker_arg_parser("mixed").parse_args(argv)
    cfg = WorkerConfig.from_env("mixed").apply_args(args)
    app = create_app(cfg)
    return serve_worker(app, app.state.worker)
