"""Run an ASGI app under uvicorn on a background thread (the router inside tests and benchmarks)."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from common.http_server import server_options
from common.net import free_port
from common.settings import HttpLimits


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1:``port`` in a daemon thread, under the HTTP limits the servers run
    with (common/http_server.py); ``stop()`` shuts it down."""

    def __init__(
        self,
        app: Any,
        port: int | None = None,
        lifespan: str = "on",
        limits: HttpLimits | None = None,
        http: str = "auto",
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        options = server_options(limits or HttpLimits.from_env(), http)
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, lifespan=lifespan, **options)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"uvicorn-{self.port}")

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> ServerThread:
        return self if self.server.started else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
