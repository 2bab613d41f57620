"""The one entry point of every worker role: `kvferry prefill|decode|mixed` and `python -m <role>_worker` (control
plane here, engine in a child process)."""

from __future__ import annotations

from common.config import WorkerConfig, worker_arg_parser
from common.worker.control import create_app, serve_worker


def main(role: str, argv: list[str] | None = None) -> int:
    args = worker_arg_parser(role).parse_args(argv)
    app = create_app(role, WorkerConfig.from_env(role).apply_args(args), freeze_gc=True)
    return serve_worker(app, app.state.worker)
