"""The mixed worker: a decode worker that also prefills for peers, composed of the two.

One engine has both roles (decode_worker/engine.py: local prefill, reservations for a remote prefill, the
running batch; prefill_worker/engine.py: prompts prefilled for a peer's reserved pages and sent over NIXL)
over one scheduler, one KV pool and one NIXL agent. A request a peer asked for is `prefill_only` (parked
once its first token is sampled, released when its transfer ends); every other request joins this
engine's decode batch. The roles share nothing per request: their commands are disjoint, an abort goes to
the prefill role when it holds the request and to the decode role otherwise, and the agent's
notifications are read only by the decode role (the prefill role only sends).

It serves the decode routes (`/internal/generate`, local or remote prefill, and `/internal/abort`, whose
engine abort reaches requests of either role) and the prefill routes (`/internal/handshake`,
`/internal/prefill`, `/internal/cancel`, `/internal/stats`), so the router can place
each request aggregated on it, disaggregated from it to another decode-capable pod, or disaggregated into
it from a prefill-capable one (router/cost_model.py).
"""

from __future__ import annotations

from fastapi import FastAPI

from common.config import WorkerConfig
from common.worker.control import create_worker_app
from common.worker.engine_host import engine_main
from common.worker.worker_state import WorkerState
from decode_worker.engine import DecodeRole
from decode_worker.routes import add_decode_routes
from prefill_worker.engine import PrefillRole
from prefill_worker.routes import add_prefill_routes

ROLES = (PrefillRole, DecodeRole)  # in this order: the prefill role aborts what it holds, the decode role the rest


def add_mixed_routes(app: FastAPI, state: WorkerState) -> None:
    add_decode_routes(app, state)
    add_prefill_routes(app, state, abort_route=False)


def create_app(cfg: WorkerConfig | None = None) -> FastAPI:
    cfg = cfg or WorkerConfig.from_env("mixed")
    return create_worker_app(WorkerState(cfg, engine_main, ROLES), add_mixed_routes)
