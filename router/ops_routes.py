"""Operations endpoints: `/health`, `/ready`, `/metrics`, `/debug/requests` and `/router/workers`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from router.errors import OpenAIError
from router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from router.runtime import RuntimeSlot
from router.timeline import RequestLog


def install_ops_routes(app: FastAPI, slot: RuntimeSlot, metrics: RouterMetrics, requests: RequestLog) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        pool = slot.pool
        counts = {role: len(pool.ready(role)) for role in ("prefill", "decode", "mixed")}
        # A decode-capable worker is enough: it prefills locally when no prefill worker is up.
        ok = counts["decode"] + counts["mixed"] > 0
        return JSONResponse({"ready": ok, "workers": counts}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/requests")
    async def recent_requests(limit: int = 100, stages: bool = False) -> dict[str, Any]:
        """This process's recent requests, newest first (each one's stages with `stages=1`, or at
        /debug/requests/{id})."""
        return {"requests": requests.list(max(1, min(limit, requests.max_kept)), stages)}

    @app.get("/debug/requests/{rid}")
    async def request_timeline(rid: str) -> dict[str, Any]:
        """One recent request's stage timeline (common/observability/timeline.py), ms since it arrived."""
        view = requests.get(rid)
        if view is None:
            raise OpenAIError(404, f"no recent request {rid!r} in this router process", code="not_found")
        return view

    @app.get("/router/workers")
    async def workers() -> dict[str, Any]:
        return slot.runtime.workers_view()
