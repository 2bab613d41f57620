"""The router's live parts behind its routes: one WireClient, the worker pool, routing and the request service.

Built and started by the app's lifespan (`RouterRuntime.build`, `start`, `stop`); routes registered before the
lifespan runs reach it through a `RuntimeSlot`.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from common.config import RouterConfig
from common.loop_lag import LoopLag
from common.loop_watchdog import LoopWatchdog
from common.slo import SloClasses, parse_slo_classes
from router.decision.cost_model import SloTargets
from router.decision.discovery import Discovery
from router.decision.dispatch import Dispatcher
from router.decision.locality import PrefixLocator, RecentPlacements
from router.decision.policy import PolicyConfig, RoutingPolicy
from router.decision.pool import WorkerPool
from router.metrics import RouterMetrics
from router.settings import RouterOptions
from router.surface.service import RouterService
from router.surface.tokenizer import ModelInfo, RouterTokenizer
from router.upstream.migration import MIGRATIONS
from router.wire import WireClient


def policy_config(opts: RouterOptions, slo: SloClasses) -> PolicyConfig:
    """`slo`: the SLO declaration, whose default class's targets apply to a request placed without a class."""
    default = slo.get(slo.default)
    return PolicyConfig(
        disagg_min_prompt_tokens=opts.disagg_min_prompt_tokens,
        local_prefix_fraction=opts.local_prefix_fraction,
        prefill_load_weight=opts.prefill_load_weight,
        imbalance_abs_tokens=opts.imbalance_abs_tokens,
        imbalance_ratio=opts.imbalance_ratio,
        decode_kv_weight=opts.decode_kv_weight,
        mode=opts.routing,
        placement=opts.placement,
        transfer_tokens_per_s=opts.transfer_tokens_per_s,
        targets=SloTargets(default.ttft_s, default.itl_s),
    )


@dataclass
class RouterRuntime:
    client: WireClient
    pool: WorkerPool
    locator: PrefixLocator
    dispatcher: Dispatcher
    service: RouterService
    discovery: Discovery
    index_reader: Any  # a PrefixIndexReader (common/prefix/reader.py) or None: route on load alone
    loop_lag: LoopLag  # this process's relay lateness, told to the workers with each request
    watchdog: LoopWatchdog  # a stuck loop: stacks written, then the process ended for a fresh one

    @classmethod
    def build(
        cls,
        config: RouterConfig,
        opts: RouterOptions,
        tok: RouterTokenizer,
        info: ModelInfo,
        discovery: Discovery,
        index_reader: Any,
        metrics: RouterMetrics,
    ) -> RouterRuntime:
        client = WireClient(connect_timeout_s=opts.connect_timeout_s, headers=config.internal_token.headers())
        pool = WorkerPool(client, opts)
        locator = PrefixLocator(index_reader, RecentPlacements(opts.recent_route_ttl_s))
        slo = parse_slo_classes(config.slo_classes, config.slo_default_class)
        metrics.declare_classes(slo.names)
        dispatcher = Dispatcher(
            pool, RoutingPolicy(policy_config(opts, slo)), locator, client, opts, metrics=metrics, slo=slo
        )
        metrics.watch_pool(lambda: list(pool.workers.values()))
        loop_lag = LoopLag()
        service = RouterService(
            tok, info, dispatcher, opts, slo, relay_lag=loop_lag if config.relay_allowance else None
        )
        watchdog = LoopWatchdog(exit_after_s=opts.stall_exit_s)
        return cls(client, pool, locator, dispatcher, service, discovery, index_reader, loop_lag, watchdog)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.watchdog.start()
        self.loop_lag.start()
        self.pool.start()
        # Discovery may report from its own thread; membership changes always run on the loop.
        self.discovery.start(lambda role, urls: loop.call_soon_threadsafe(self.pool.set_targets, role, urls))

    async def stop(self) -> None:
        self.discovery.stop()
        await self.loop_lag.stop()
        await self.watchdog.stop()
        await self.pool.stop()
        await self.client.aclose()
        reader = self.index_reader
        if hasattr(reader, "aclose"):
            await reader.aclose()
        elif hasattr(reader, "close"):
            reader.close()

    def workers_view(self) -> dict[str, Any]:
        """`GET /router/workers`: each worker's state, the routing decisions so far and the placement inputs."""
        locator = self.locator
        return {
            "workers": self.pool.snapshot(),
            "decisions": dict(self.dispatcher.decisions),
            "prefix_index": "disabled" if locator.reader is None else ("ok" if locator.redis_ok else "unavailable"),
            "inflight": self.service.inflight,
            "loop_lag_p99_ms": round(self.loop_lag.p99_s() * 1e3, 2),
            # what this process's admission multiplies predicted TTFTs by (router/decision/ttft_error.py)
            "ttft_error_factor": round(self.dispatcher.ttft_error.factor(time.monotonic()), 3),
            "remote_prefill_excess_s": round(self.dispatcher.remote_excess.excess_s, 4),
            "process": os.getpid(),  # which router process answered (each keeps its own factor and placements)
            "migrations": MIGRATIONS.snapshot(),
            "placement": placement_inputs(self.pool, self.dispatcher.policy),
        }


def placement_inputs(pool: WorkerPool, policy: RoutingPolicy) -> dict[str, Any]:
    """What the placement decision reads (router/decision/cost_model.py): the mode, the SLO targets and each
    worker's measured prefill rate, chunk size and queued prefill tokens; and for the planner (planner/source.py)
    each worker's role, whether it is routable and its step-time coefficients."""
    cfg = policy.cfg
    return {
        "mode": cfg.placement,
        "slo_default_class": {"ttft_s": cfg.targets.ttft_s, "itl_s": cfg.targets.itl_s},
        "transfer_tokens_per_s": cfg.transfer_tokens_per_s,
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
                "step_overruns": w.load.step_overruns if w.load else 0,
                "step_stalls": w.load.step_stalls if w.load else 0,
                "queued_prefill_tokens": w.load.queued_prefill_tokens if w.load else 0,
                "inflight_tokens": w.inflight_tokens,
                # what this process reckons the other router processes place here (router/decision/peers.py)
                "others_per_s": {
                    "prompt_tokens": round(w.peers.rate, 1),
                    "decodes": round(w.decode_peers.rate, 3),
                },
                # the capacity model's inputs (common/capacity.py), for the planner
                "role": w.role,
                "up": w.up,
                "step_coefficients": dict(w.load.step_coefficients) if w.load else {},
            }
            for w in pool.workers.values()
        },
    }


class RuntimeSlot:
    """Where routes find the runtime: empty until the app's lifespan has built it."""

    def __init__(self) -> None:
        self._runtime: RouterRuntime | None = None

    def fill(self, runtime: RouterRuntime | None) -> None:
        self._runtime = runtime

    @property
    def runtime(self) -> RouterRuntime:
        if self._runtime is None:
            raise RuntimeError("the router's runtime is not started (the app's lifespan has not run)")
        return self._runtime

    @property
    def service(self) -> RouterService:
        return self.runtime.service

    @property
    def pool(self) -> WorkerPool:
        return self.runtime.pool
