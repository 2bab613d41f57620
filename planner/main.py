"""`kvferry planner`: every ``--interval`` seconds reads the routers (planner/source.py), decides the replica
counts (planner/core.py) and patches the worker Deployments' scale (planner/scaler.py), or with ``--dry-run``
only logs and exports what it would do. Its own ``GET /metrics`` (``--port``) exports each decision:

- ``kvferry_planner_desired_replicas{role}``: what it asks for (the external metric an HPA or KEDA may
  read instead of letting the planner patch: an HPA on it with ``target.averageValue: 1`` holds that many);
- ``kvferry_planner_planned_replicas{role}``: what the model sized before hysteresis;
- ``kvferry_planner_arrival_rate``, ``kvferry_planner_forecast_rate`` (requests/s),
  ``kvferry_planner_queue_wait_seconds``, ``kvferry_planner_decisions_total{role,direction}``.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import deque

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from common import settings_registry as reg
from common.capacity import StepCost
from common.slo import parse_slo_classes
from planner.core import Decision, Planner, PlannerConfig
from planner.observe import Totals, observation, trim_window
from planner.scaler import DeploymentScaler, DryRun, Scaler
from planner.sizing import Counts, FleetSpec, OfferedLoad
from planner.source import read

__all__ = ["PlannerMetrics", "build_parser", "build_planner", "main", "step"]

log = logging.getLogger("kvferry.planner")
ROLES = ("prefill", "decode", "mixed")


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.desired = Gauge("kvferry_planner_desired_replicas", "Replicas the planner asks for", ["role"], registry=r)
        self.planned = Gauge(
            "kvferry_planner_planned_replicas", "Replicas the model sized, before hysteresis", ["role"], registry=r
        )
        self.rate = Gauge("kvferry_planner_arrival_rate", "Requests/s arriving at the routers", registry=r)
        self.forecast = Gauge("kvferry_planner_forecast_rate", "Requests/s the plan is sized for", registry=r)
        self.wait = Gauge("kvferry_planner_queue_wait_seconds", "Predicted wait of a request arriving now", registry=r)
        self.decisions = Counter(
            "kvferry_planner_decisions_total", "Scale decisions", ["role", "direction"], registry=r
        )

    def record(self, d: Decision, rate: float, wait: float) -> None:
        for role in ROLES:
            self.desired.labels(role=role).set(getattr(d.targets, role))
            self.planned.labels(role=role).set(getattr(d.planned, role))
            reason = d.reasons.get(role, "")
            if reason:
                self.decisions.labels(role=role, direction=reason.split()[0]).inc()
        self.rate.set(rate)
        self.forecast.set(d.forecast_rate)
        self.wait.set(wait)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvferry planner", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--routers",
        default="http://127.0.0.1:8000",
        help="router base URLs, comma-separated (a headless Service name: every address it resolves to)",
    )
    p.add_argument(
        "--slo",
        default=None,
        help="the SLO classes (default: KVFERRY_SLO_CLASSES); the plan holds the first class's targets",
    )
    p.add_argument("--interval", type=float, default=5.0, help="seconds between decisions")
    p.add_argument("--window", type=float, default=30.0, help="seconds the arrival rate and lengths are read over")
    p.add_argument(
        "--startup", type=float, default=60.0, help="a new worker pod's seconds to ready (the forecast horizon)"
    )
    p.add_argument(
        "--step-reserve",
        type=float,
        default=0.0,
        help="keep up with a load step of (1 + this) x the load of the last minutes with the pods already up "
        "(1: a doubling; 0: none)",
    )
    p.add_argument("--namespace", default="kvferry")
    p.add_argument(
        "--deployments",
        default="prefill=kvferry-prefill,decode=kvferry-decode",
        help="role=Deployment pairs the planner sizes (add mixed=kvferry-mixed for mixed pods)",
    )
    p.add_argument("--min", default="prefill=1,decode=1,mixed=1", help="fewest replicas per role")
    p.add_argument("--max", default="prefill=64,decode=64,mixed=64", help="most replicas per role")
    p.add_argument(
        "--chunk-tokens", type=int, default=2048, help="prompt tokens per prefill step (KVFERRY_MAX_PREFILL_TOKENS)"
    )
    p.add_argument("--max-running", type=int, default=256, help="decode batch slots (KVFERRY_MAX_RUNNING)")
    p.add_argument("--kv-tokens", type=int, default=800_000, help="a decode worker's KV pool, in tokens")
    p.add_argument("--port", type=int, default=9400, help="its /metrics port (0: none)")
    p.add_argument("--dry-run", action="store_true", help="log and export the decisions; patch nothing")
    p.add_argument("--once", action="store_true", help="one decision, then exit (for checks)")
    return p


def _pairs(text: str, kind: type = str) -> dict[str, object]:
    return {k.strip(): kind(v.strip()) for k, _, v in (item.partition("=") for item in text.split(",") if item.strip())}


def step(
    planner: Planner,
    client: httpx.Client,
    routers: list[str],
    history: deque[Totals],
    window_s: float,
    scaler: Scaler,
    metrics: PlannerMetrics,
    headers: dict[str, str] | None = None,
    now: float | None = None,
) -> Decision | None:
    """One reading and one decision; None when no router answered or no worker has fitted its step model yet."""
    now = time.monotonic() if now is None else now
    try:
        view = read(client, routers, now, headers)
    except ConnectionError as exc:
        log.warning("no reading", extra={"error": str(exc)})
        return None
    history.append(view.totals)
    trim_window(history, now, window_s)
    if view.cost is None or len(history) < 2:
        return None
    planner.spec = FleetSpec(**{**planner.spec.__dict__, "cost": view.cost})
    fallback = OfferedLoad(0.0, 1.0, 1.0)
    obs = observation(history[0], view.totals, view.queue_wait_s, view.ready, fallback)
    decision = planner.decide(obs)
    metrics.record(decision, obs.load.rate, obs.queue_wait_s)
    if decision.changed:
        log.info("decision", extra={"targets": decision.targets.__dict__, "reasons": decision.reasons})
    scaler.apply(decision.targets)
    return decision


def build_planner(args: argparse.Namespace) -> Planner:
    """The planner the flags describe; its step cost is the workers' own fit, replaced at every reading."""
    cls = parse_slo_classes(args.slo or reg.SLO_CLASSES.read()).classes[0]
    lo, hi = _pairs(args.min, int), _pairs(args.max, int)
    roles = tuple(r for r in ROLES if r in _pairs(args.deployments))
    spec = FleetSpec(
        cost=StepCost(),
        ttft_s=cls.ttft_s or 10.0,
        itl_s=cls.itl_s,
        percentile=cls.percentile,
        chunk_tokens=args.chunk_tokens,
        max_running=args.max_running,
        kv_tokens=args.kv_tokens,
        roles=roles,
        min_workers=Counts(**{r: int(lo.get(r, 0)) if r in roles else 0 for r in ROLES}),  # type: ignore[arg-type]
        max_workers=Counts(**{r: int(hi.get(r, 0)) if r in roles else 0 for r in ROLES}),  # type: ignore[arg-type]
    )
    return Planner(
        spec, PlannerConfig(interval_s=args.interval, horizon_s=args.startup, step_reserve=args.step_reserve)
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    deployments = {k: str(v) for k, v in _pairs(args.deployments).items()}
    planner = build_planner(args)
    scaler: Scaler
    if args.dry_run:
        scaler = DryRun()
    else:
        from kubernetes import client as k8s
        from kubernetes import config as k8s_config

        try:
            k8s_config.load_incluster_config()
        except k8s_config.ConfigException:
            k8s_config.load_kube_config()
        ds = DeploymentScaler(k8s.AppsV1Api(), args.namespace, deployments)
        current = ds.current()
        planner.targets = Counts(**{r: current.get(r, 0) for r in ROLES})
        scaler = ds
    metrics = PlannerMetrics()
    if args.port:
        start_http_server(args.port, registry=metrics.registry)
    token = reg.API_KEY.read()
    headers = {"authorization": f"Bearer {token}"} if token else None
    routers = [u.strip().rstrip("/") for u in args.routers.split(",") if u.strip()]
    history: deque[Totals] = deque()
    with httpx.Client(timeout=2.0) as client:
        while True:
            started = time.monotonic()
            step(planner, client, routers, history, args.window, scaler, metrics, headers)
            if args.once:
                return 0
            time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
