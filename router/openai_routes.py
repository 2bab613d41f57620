"""`/v1/models`, `/v1/completions` and `/v1/chat/completions`: admission, the request record, streaming or not."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.managed_stream import ManagedStream
from router.errors import OpenAIError, model_not_found, no_worker
from router.middleware import COUNTED
from router.runtime import RuntimeSlot
from router.surface.disconnect import ClientGone, unless_disconnected
from router.surface.job import Job
from router.surface.openai_api import ChatCompletionRequest, CompletionRequest
from router.surface.responses import SSE_HEADERS
from router.surface.service import SLO_CLASS_HEADER
from router.surface.tokenizer import ModelInfo
from router.timeline import RequestLog


def install_openai_routes(app: FastAPI, slot: RuntimeSlot, info: ModelInfo, requests: RequestLog) -> None:
    def model_card() -> dict[str, Any]:
        # max_model_len: vLLM's field, which load generators and evaluation clients read to size their prompts.
        card = {"id": info.name, "object": "model", "created": info.created, "owned_by": "kvferry"}
        return {**card, "max_model_len": info.max_context}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        if not info.serves(model):
            raise model_not_found(model)
        return model_card()

    async def serve(
        request: Request, req: ChatCompletionRequest | CompletionRequest, prepare: Callable[[Any], Awaitable[Job]]
    ) -> Response:
        # Starlette keeps the parsed JSON body on the request for its life, a stream's whole length: `req` has what
        # it holds, and a prompt's ids in lists are what the collector walks (common/protocol.py TokenIds).
        vars(request).pop("_json", None)
        service, pool = slot.service, slot.pool
        rec = requests.begin(req.stream, request.headers.get("traceparent"), request.url.path)
        request.scope["state"][COUNTED] = True  # the record counts it (router/middleware.py counts the rest)
        try:
            if not info.serves(req.model):
                raise model_not_found(req.model or "")
            ticket = service.admit()
        except OpenAIError as exc:
            rec.finish(exc.status, "rejected")
            raise
        handed_off = False
        job: Job | None = None
        try:
            job = await prepare(req)
            job.slo_class = service.slo_class(req.priority, request.headers.get(SLO_CLASS_HEADER))
            job.record = rec
            rec.slo = service.slo.get(job.slo_class)
            rec.prepared(job.rid, sum(len(p) for p in job.prompts))
            if not pool.decoders():
                raise no_worker("decode")
            choices = await unless_disconnected(request, service.start(job))
            rec.first_token(choices)
            if req.stream:
                body = service.stream(job, choices)

                async def on_close() -> None:
                    try:
                        await body.aclose()
                    finally:
                        await service.end(ticket, choices)
                        rec.finish_choices(200, choices)

                handed_off = True
                return ManagedStream(body, on_close, "text/event-stream", SSE_HEADERS)
            result = await unless_disconnected(request, service.collect(job, choices))
            rec.finish_choices(200, choices)
            return JSONResponse(result)
        except ClientGone:
            rec.finish_choices(499, job.choices if job is not None else [], client_gone=True)
            return Response(status_code=499)
        except OpenAIError as exc:
            rec.finish(exc.status, "rejected")
            raise
        except Exception:
            rec.finish(500, "error")
            raise
        finally:
            if not handed_off:
                rec.finish(499, "abort")  # cancelled (a no-op when counted above)
                await service.end(ticket, job.choices if job is not None else [])

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await serve(request, body, slot.service.prompts.prepare_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await serve(request, body, slot.service.prompts.prepare_chat)
