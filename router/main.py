"""`kvferry router`: settings from KVFERRY_* env vars (common/settings_registry.py), flags on top."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict, fields
from typing import Any

from common import settings_registry as reg
from common.config import RouterConfig
from common.http_server import server_options
from common.log import setup_logging
from common.settings import HttpLimits
from router.settings import RouterOptions

__all__ = ["build_parser", "child_app", "main", "parse_config"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvferry router",
        description="OpenAI-compatible front end that routes prefill and decode across worker pods.",
    )
    reg.add_flags(p, RouterConfig)
    p.add_argument("--log-level", dest="log_level", help=f"{reg.LOG_LEVEL.doc} (env {reg.LOG_LEVEL.name})")
    reg.add_flags(p.add_argument_group("router options (env KVFERRY_ROUTER_<NAME>)"), RouterOptions, dest_prefix="opt_")
    return p


def parse_config(argv: list[str] | None) -> tuple[RouterConfig, RouterOptions, argparse.Namespace]:
    args = build_parser().parse_args(argv)
    config = RouterConfig.from_env()
    for f in fields(config):
        value = getattr(args, f.name, None)
        if value is not None:
            setattr(config, f.name, value)
    options = RouterOptions.from_env()
    for f in fields(options):
        value = getattr(args, f"opt_{f.name}", None)
        if value is not None:
            setattr(options, f.name, value)
    return config, options, args


# Several router processes (options.workers > 1): uvicorn's supervisor starts them on one listening
# socket and restarts any that dies; each builds its app from the settings the parent resolved (env and
# flags), handed down in reg.ROUTER_CHILD_SETTINGS.


def child_app() -> Any:
    """The app of one of several router processes (uvicorn factory)."""
    from router.app import create_app

    data = json.loads(reg.ROUTER_CHILD_SETTINGS.read())
    # Always: a child process is not started through common/cli.py, and without a handler its warnings came out
    # bare ("slow garbage collection", no time or fields) from logging's last resort.
    setup_logging(data["log_level"])
    return create_app(
        reg.rebuilt(RouterConfig, data["config"]), reg.rebuilt(RouterOptions, data["options"]), freeze_gc=True
    )


def main(argv: list[str] | None = None) -> int:
    config, options, args = parse_config(argv)
    if args.log_level:
        setup_logging(args.log_level)
    import uvicorn

    log = logging.getLogger("kvferry.router")
    log.warning(
        "router starting",
        extra={
            "port": config.port,
            "model": config.model,
            "discovery": config.discovery,
            "auth": bool(config.api_key),
            "processes": options.workers,
        },
    )
    # uvloop and httptools when installed (the default "auto"): bench/RESULTS.md has what each is worth.
    # The HTTP limits (KVFERRY_HTTP_*) hold for every router process; each reads them from the same env.
    server = dict(
        host=config.host,
        port=config.port,
        loop=options.event_loop,
        lifespan="on",
        **server_options(HttpLimits.from_env(), options.http),
    )
    if options.workers > 1:
        from router.metrics import prepare_multiprocess_dir

        prepare_multiprocess_dir()  # the processes' metrics add up in one directory (router/metrics.py)
        settings = json.dumps({"config": asdict(config), "options": asdict(options), "log_level": args.log_level})
        # uvicorn's supervisor restarts a child that dies at start, forever: a setting lost on the way down must
        # stop the parent here, not crash-loop the children behind a port that never answers.
        handed = json.loads(settings)
        if (
            reg.rebuilt(RouterConfig, handed["config"]) != config
            or reg.rebuilt(RouterOptions, handed["options"]) != options
        ):
            raise SystemExit(
                "router settings do not survive the hand-down to its processes (KVFERRY_ROUTER_WORKERS > 1)"
            )
        os.environ[reg.ROUTER_CHILD_SETTINGS.name] = settings
        uvicorn.run("router.main:child_app", factory=True, workers=options.workers, **server)  # type: ignore[arg-type]
        return 0
    from router.app import create_app

    uvicorn.run(create_app(config, options, freeze_gc=True), **server)  # type: ignore[arg-type]
    return 0
