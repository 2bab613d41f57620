"""The router's FastAPI app: OpenAI endpoints in front, the worker pool and routing behind (the runtime its
lifespan builds is router/runtime.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from common.config import RouterConfig
from common.gc_pauses import watch_collector
from common.http_guard import RequestLimits
from common.http_server import REFUSAL_HOOK
from common.log import limit_tracebacks
from common.observability.tracing import init_tracing
from common.settings import HttpLimits
from router.decision.discovery import Discovery, KubernetesDiscovery, StaticDiscovery
from router.errors import install_error_handlers
from router.extra_routes import install_extra_routes
from router.metrics import RouterMetrics
from router.middleware import FrontDoor, ResponseCounter
from router.openai_routes import install_openai_routes
from router.ops_routes import install_ops_routes
from router.runtime import RouterRuntime, RuntimeSlot
from router.settings import RouterOptions
from router.surface.tokenizer import ModelInfo, RouterTokenizer, load_tokenizer
from router.timeline import RequestLog

__all__ = ["create_app"]


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
    freeze_gc: bool = False,
) -> FastAPI:
    """Builds the router app; each part defaults to what `config` names (``use_redis=False``: route on load alone).
    ``freeze_gc``: the serving process's own app (router/main.py), whose startup objects live as long as it does."""
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
    limit_tracebacks()  # a 500's traceback at most once a minute per failure (common/log.py)
    init_tracing("kvferry-router")  # off unless an OTLP endpoint is set (common/observability/tracing.py)
    metrics = RouterMetrics()
    requests = RequestLog(metrics)
    slot = RuntimeSlot()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = RouterRuntime.build(config, opts, tok, info, disc, index_reader, metrics)
        slot.fill(runtime)
        runtime.start()
        # The tokenizer, templates and app are built: out of the collector's walks, so a collection during
        # streaming costs the objects made since (common/gc_pauses.py); long ones are logged.
        try:
            async with watch_collector(metrics.gc_pause.observe, freeze_gc):
                yield
        finally:
            await runtime.stop()

    app = FastAPI(title="kvferry router", version="1", lifespan=lifespan)
    install_error_handlers(app)
    # FrontDoor (auth) runs first, then the HTTP limits (common/http_guard.py), then FastAPI.
    app.add_middleware(RequestLimits, limits=http_limits or HttpLimits.from_env())
    app.add_middleware(FrontDoor, api_key=config.api_key)

    def static_paths() -> list[str]:
        return [path for r in app.routes if "{" not in (path := getattr(r, "path", "{"))]

    # Outermost: counts FrontDoor's refusals too.
    app.add_middleware(ResponseCounter, metrics=metrics, static_paths=static_paths)
    app.state.router = slot

    def http_refused(status: int) -> None:  # a head refused before it was parsed (common/http_server.py)
        metrics.http_requests.labels(method="unparsed", route="unparsed", status=str(status)).inc()

    setattr(app.state, REFUSAL_HOOK, http_refused)
    install_openai_routes(app, slot, info, requests)
    install_extra_routes(app, slot)  # /v1/responses, /tokenize, /detokenize
    install_ops_routes(app, slot, metrics, requests)
    return app
