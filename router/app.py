"""The router's FastAPI app: OpenAI endpoints in front, the worker pool and routing behind.

``create_app(config, options)`` wires the parts (one shared WireClient, router/wire.py, for every worker
call);
the request pipeline is router/service.py, routing router/policy.py + router/upstream.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.config import RouterConfig
from common.http_guard import RequestLimits
from common.http_server import REFUSAL_HOOK
from common.log import limit_tracebacks
from common.managed_stream import ManagedStream
from common.observability.tracing import init_tracing
from common.settings import HttpLimits
from router.admission import AdmissionLimits
from router.cost_model import SloTargets
from router.disconnect import ClientGone, unless_disconnected
from router.discovery import Discovery, KubernetesDiscovery, StaticDiscovery
from router.errors import OpenAIError, install_error_handlers, model_not_found, no_worker
from router.extra_routes import install_extra_routes
from router.locality import PrefixLocator, RecentPlacements
from router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from router.middleware import COUNTED, FrontDoor, ResponseCounter
from router.migration import MIGRATIONS
from router.openai_api import ChatCompletionRequest, CompletionRequest
from router.policy import PolicyConfig, RoutingPolicy
from router.pool import WorkerPool
from router.responses import SSE_HEADERS
from router.service import Job, RouterService
from router.settings import RouterOptions
from router.timeline import RequestLog
from router.tokenizer import ModelInfo, RouterTokenizer, load_tokenizer
from router.upstream import Dispatcher
from router.wire import WireClient

log = logging.getLogger("kvferry.router")

__all__ = ["create_app"]


def placement_inputs(pool: WorkerPool, policy: RoutingPolicy) -> dict[str, Any]:
    """What the placement decision reads (router/cost_model.py): the mode, the SLO targets and each
    worker's measured prefill rate, chunk size and queued prefill tokens."""
    cfg = policy.cfg
    return {
        "mode": cfg.placement,
        "slo": {"ttft_s": cfg.slo.ttft_s, "itl_s": cfg.slo.itl_s},
        "transfer_tokens_per_s": cfg.slo.transfer_tokens_per_s,
        "fixed": {
            "disagg_min_prompt_tokens": cfg.disagg_min_prompt_tokens,
            "local_prefix_fraction": cfg.local_prefix_fraction,
        },
        "workers": {
            w.url: {
                "prefill_tokens_per_s": w.load.prefill_tokens_per_s if w.load else 0.0,
                "prefill_chunk_tokens": w.load.prefill_chunk_tokens if w.load else 0,
                "prefill_step_tokens_per_s": w.load.prefill_step_tokens_per_s if w.load else 0.0,
                "decode_step_s": w.load.decode_step_s if w.load else 0.0,
                "itl_target_s": w.load.itl_target_s if w.load else 0.0,
                "queued_prefill_tokens": w.load.queued_prefill_tokens if w.load else 0,
                "inflight_tokens": w.inflight_tokens,
            }
            for w in pool.workers.values()
        },
    }


def _discovery_for(config: RouterConfig) -> Discovery:
    if config.discovery == "k8s":
        return KubernetesDiscovery(config.namespace)
    if config.discovery != "static":
        raise ValueError(f"unknown discovery {config.discovery!r} (static | k8s)")
    return StaticDiscovery(config.prefill_urls, config.decode_urls, config.mixed_urls)


def create_app(
    config: RouterConfig,
    options: RouterOptions | None = None,
    *,
    tokenizer: RouterTokenizer | None = None,
    model_info: ModelInfo | None = None,
    discovery: Discovery | None = None,
    index_reader: Any = None,
    use_redis: bool = True,
    http_limits: HttpLimits | None = None,
) -> FastAPI:
    """Builds the router app. ``tokenizer``/``model_info`` default to loading ``config.model``;
    ``discovery`` to the one ``config.discovery`` names; ``index_reader`` to a Redis
    PrefixIndexReader on ``config.redis_url`` (``use_redis=False``: route on load alone); ``http_limits`` to
    ``HttpLimits.from_env()``."""
    opts = options or RouterOptions.from_env()
    if tokenizer is None or model_info is None:
        tokenizer, model_info = load_tokenizer(config.model, opts.tokenizer)
    tok, info = tokenizer, model_info
    disc = discovery or _discovery_for(config)
    if index_reader is None and use_redis and config.redis_url:
        from common.prefix.reader import PrefixIndexReader

        index_reader = PrefixIndexReader(
            config.redis_url, info.name, socket_timeout_s=opts.redis_timeout_s, access=config.redis_access
        )
    state: dict[str, Any] = {}
    limit_tracebacks()  # a 500's traceback at most once a minute per failure (common/log.py)
    init_tracing("kvferry-router")  # off unless an OTLP endpoint is set (common/observability/tracing.py)
    metrics = RouterMetrics()
    requests = RequestLog(metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = WireClient(connect_timeout_s=opts.connect_timeout_s, headers=config.internal_token.headers())
        pool = WorkerPool(
            client, opts.poll_interval_s, opts.poll_timeout_s, opts.down_after_failures, opts.down_after_s
        )
        policy = RoutingPolicy(
            PolicyConfig(
                disagg_min_prompt_tokens=opts.disagg_min_prompt_tokens,
                local_prefix_fraction=opts.local_prefix_fraction,
                prefill_load_weight=opts.prefill_load_weight,
                imbalance_abs_tokens=opts.imbalance_abs_tokens,
                imbalance_ratio=opts.imbalance_ratio,
                decode_kv_weight=opts.decode_kv_weight,
                mode=opts.routing,
                placement=opts.placement,
                slo=SloTargets(opts.slo_ttft_s, opts.slo_itl_s, opts.transfer_tokens_per_s),
            )
        )
        locator = PrefixLocator(index_reader, RecentPlacements(opts.recent_route_ttl_s))
        dispatcher = Dispatcher(
            pool,
            policy,
            locator,
            client,
            connect_timeout_s=opts.connect_timeout_s,
            first_token_timeout_s=opts.first_token_timeout_s,
            inter_token_timeout_s=opts.inter_token_timeout_s,
            retry_after_s=opts.retry_after_s,
            limits=AdmissionLimits(
                opts.admit_max_waiting, opts.admit_max_queued_prefill_tokens, opts.admit_queue_seconds
            ),
            metrics=metrics,
        )
        metrics.watch_pool(lambda: list(pool.workers.values()))
        service = RouterService(tok, info, dispatcher, opts)
        state.update(pool=pool, service=service, dispatcher=dispatcher, locator=locator)
        loop = asyncio.get_running_loop()
        pool.start()
        # Discovery may report from its own thread; membership changes always run on the loop.
        disc.start(lambda role, urls: loop.call_soon_threadsafe(pool.set_targets, role, urls))
        try:
            yield
        finally:
            disc.stop()
            await pool.stop()
            await client.aclose()
            if hasattr(index_reader, "aclose"):
                await index_reader.aclose()
            elif hasattr(index_reader, "close"):
                index_reader.close()

    app = FastAPI(title="kvferry router", version="1", lifespan=lifespan)
    install_error_handlers(app)
    # FrontDoor (auth) runs first, then the HTTP limits (common/http_guard.py), then FastAPI.
    app.add_middleware(RequestLimits, limits=http_limits or HttpLimits.from_env())
    app.add_middleware(FrontDoor, api_key=config.api_key)

    def static_paths() -> list[str]:
        return [path for r in app.routes if "{" not in (path := getattr(r, "path", "{"))]

    # Outermost: counts FrontDoor's refusals too.
    app.add_middleware(ResponseCounter, metrics=metrics, static_paths=static_paths)
    app.state.router = state

    def http_refused(status: int) -> None:  # a head refused before it was parsed (common/http_server.py)
        metrics.http_requests.labels(method="unparsed", route="unparsed", status=str(status)).inc()

    setattr(app.state, REFUSAL_HOOK, http_refused)

    # ---- OpenAI endpoints ------------------------------------------------------------------------
    def model_card() -> dict[str, Any]:
        return {"id": info.name, "object": "model", "created": info.created, "owned_by": "kvferry"}

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
        service: RouterService = state["service"]
        pool: WorkerPool = state["pool"]
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
            job.record = rec
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
        service: RouterService = state["service"]
        return await serve(request, body, service.prepare_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        service: RouterService = state["service"]
        return await serve(request, body, service.prepare_chat)

    install_extra_routes(app, state)  # /v1/responses, /tokenize, /detokenize

    # ---- operations ------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        pool: WorkerPool = state["pool"]
        counts = {role: len(pool.ready(role)) for role in ("prefill", "decode", "mixed")}
        # A decode-capable worker is enough: it prefills locally when no prefill worker is up.
        ok = counts["decode"] + counts["mixed"] > 0
        return JSONResponse({"ready": ok, "workers": counts}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/requests")
    async def recent_requests(limit: int = 100) -> dict[str, Any]:
        """This process's recent requests, newest first (their stages: /debug/requests/{id})."""
        return {"requests": requests.list(max(1, min(limit, requests.max_kept)))}

    @app.get("/debug/requests/{rid}")
    async def request_timeline(rid: str) -> dict[str, Any]:
        """One recent request's stage timeline (common/observability/timeline.py), ms since it arrived."""
        view = requests.get(rid)
        if view is None:
            raise OpenAIError(404, f"no recent request {rid!r} in this router process", code="not_found")
        return view

    @app.get("/router/workers")
    async def workers() -> dict[str, Any]:
        pool: WorkerPool = state["pool"]
        dispatcher: Dispatcher = state["dispatcher"]
        locator: PrefixLocator = state["locator"]
        service: RouterService = state["service"]
        return {
            "workers": pool.snapshot(),
            "decisions": dict(dispatcher.decisions),
            "prefix_index": "disabled" if locator.reader is None else ("ok" if locator.redis_ok else "unavailable"),
            "inflight": service.inflight,
            "migrations": MIGRATIONS.snapshot(),
            "placement": placement_inputs(pool, dispatcher.policy),
        }

    return app
