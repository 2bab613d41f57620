"""A deployment for the serving benchmark: redis-server, workers and a router as separate processes, each
started the way its pod starts it (``kvferry prefill|decode|router``, configured by ``KVFERRY_*`` env vars).

Shapes (``DeploySpec.mode``):
  - ``disagg``: prefill and decode workers; with n devices the first n // 2 prefill, the rest decode
    (2 devices: 1 prefill + 1 decode).
  - ``agg``: n decode workers and no prefill worker: the router has each decode worker prefill its own
    requests (router/decision/policy.py: "no-prefill").
With GPUs each worker process sees one GPU (``CUDA_VISIBLE_DEVICES``, ``KVFERRY_DEVICE=cuda``), as in a
pod. Every process gets its own session, so stopping kills its children (the engine process) too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.devcluster.process import ClusterError, ManagedProcess, kvferry_argv
from common.devcluster.redis_server import redis_server, wait_redis
from common.net import free_port

__all__ = ["DeployError", "DeploySpec", "Deployment", "settle_logs", "start_deployment"]

Say = Callable[[str], None]
REPO_ROOT = Path(__file__).resolve().parents[1]


class DeployError(RuntimeError):
    pass


K8S_ROUTER_PROCESSES = 2  # the router Deployment's CPU limit, so its KVFERRY_ROUTER_WORKERS


@dataclass(frozen=True)
class DeploySpec:
    mode: str  # agg | disagg | adaptive (disagg's roles, adaptive placement) | mixed (all mixed, adaptive)
    model: str
    tokenizer_dir: str  # the router's tokenizer (bench/synthetic_tokenizer.py)
    gpus: tuple[str, ...] = ()  # one worker per GPU; empty: CPU workers
    cpu_workers: int = 2  # worker processes when there are no GPUs
    worker_env: dict[str, str] = field(default_factory=dict)
    router_env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 300.0
    log_dir: Path = Path(".")

    @property
    def devices(self) -> int:
        """Distinct devices the workers run on (``--gpus 0,0`` puts two workers on one GPU)."""
        return len(set(self.gpus)) or self.cpu_workers

    def roles(self) -> list[str]:
        n = len(self.gpus) or self.cpu_workers
        if self.mode == "agg":
            return ["decode"] * n
        if self.mode in ("disagg", "adaptive"):
            if n < 2:
                raise DeployError(f"{self.mode} needs at least 2 workers (one prefill, one decode)")
            return ["prefill"] * (n // 2) + ["decode"] * (n - n // 2)
        if self.mode == "mixed":
            return ["mixed"] * n
        raise DeployError(f"unknown mode {self.mode!r} (agg | disagg | adaptive | mixed)")

    @property
    def placement(self) -> str:
        """The router's placement (router/decision/cost_model.py) for this mode."""
        return "adaptive" if self.mode in ("adaptive", "mixed") else "fixed"


@dataclass
class Deployment:
    spec: DeploySpec
    router_url: str
    redis: ManagedProcess
    workers: list[ManagedProcess]
    router: ManagedProcess | None = None

    @property
    def parts(self) -> list[ManagedProcess]:
        return [p for p in (self.router, *self.workers, self.redis) if p is not None]

    def dead_parts(self) -> list[ManagedProcess]:
        return [p for p in self.parts if not p.alive()]

    def describe_failure(self, parts: list[ManagedProcess] | None = None) -> str:
        shown = parts if parts is not None else self.parts
        return "\n".join(f"  {p.name} ({p.log_path}):\n{_indented(p.log_tail(40))}" for p in shown)

    def router_view(self) -> dict[str, Any]:
        """The router's debug view (/router/workers): worker loads and its placement decisions."""
        return get_json(f"{self.router_url}/router/workers", 5.0) or {}

    def stop(self) -> None:
        # Router first (no new requests), then the workers together (they drain what is left), Redis last.
        for group, grace_s in (([self.router], 10.0), (self.workers, 10.0), ([self.redis], 3.0)):
            parts = [p for p in group if p is not None]
            for p in parts:
                p.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in parts:
                p.finish(deadline)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def get_json(url: str, timeout_s: float) -> dict[str, Any] | None:
    """GET a JSON body; None on any failure or non-200 (readiness polls treat both as 'not yet')."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read()) if resp.status == 200 else None
    except (OSError, urllib.error.URLError, ValueError):
        return None


def settle_logs(log_dir: Path, failed: bool, asked_for: bool, say: Say) -> None:
    """A failed run keeps its deployment's logs (and says where); a good one removes them unless they were asked
    for (`--log-dir`)."""
    if failed:
        say(f"logs kept in {log_dir}")
    elif not asked_for:
        shutil.rmtree(log_dir, ignore_errors=True)


def _start_redis(log_dir: Path, env: dict[str, str]) -> ManagedProcess:
    try:
        part = redis_server(free_port(), log_dir / "redis.log", env)
        part.start()
        wait_redis(part)
    except ClusterError as e:
        raise DeployError(str(e)) from None
    return part


def _indented(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines()) or "    (empty log)"


def _worker(role: str, index: int, spec: DeploySpec, redis_url: str, base_env: dict[str, str]) -> ManagedProcess:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(base_env)
    env.update(
        KVFERRY_HOST="127.0.0.1",
        KVFERRY_PORT=str(port),
        KVFERRY_ADVERTISE_URL=url,
        KVFERRY_POD_NAME=f"bench-{spec.mode}-{role}-{index}",
        KVFERRY_REDIS_URL=redis_url,
        KVFERRY_MODEL=spec.model,
        KVFERRY_PREFILL_PEERS="http://127.0.0.1",  # its peers: every worker of this deployment (all on loopback)
    )
    if spec.gpus:
        env["CUDA_VISIBLE_DEVICES"] = spec.gpus[index]
        env.setdefault("KVFERRY_DEVICE", "cuda")
    env.update(spec.worker_env)  # the caller's overrides win, as a pod's manifest would
    log = spec.log_dir / f"{spec.mode}-{role}-{index}.log"
    return ManagedProcess(f"{role}-{index}", kvferry_argv(role), env, log, url, cwd=REPO_ROOT)


def _wait(
    deployment: Deployment,
    parts: list[ManagedProcess],
    ready: Callable[[ManagedProcess], bool],
    deadline: float,
    say: Say,
) -> None:
    pending = list(parts)
    start = time.monotonic()
    last_note = start
    while pending:
        dead = deployment.dead_parts()
        if dead:
            raise DeployError(
                f"{', '.join(p.name for p in dead)} exited during startup:\n{deployment.describe_failure(dead)}"
            )
        pending = [p for p in pending if not ready(p)]
        now = time.monotonic()
        if pending and now > deadline:
            raise DeployError(
                f"not ready before the deadline: {', '.join(p.name for p in pending)}\n"
                + deployment.describe_failure(pending)
            )
        if pending and now - last_note >= 15.0:
            last_note = now
            say(f"  waiting for {', '.join(p.name for p in pending)} ({now - start:.0f} s)")
        if pending:
            time.sleep(0.25)


def start_deployment(spec: DeploySpec, say: Say) -> Deployment:
    """Starts Redis, the workers (in parallel) and the router; returns once the router reports every
    worker ready. Raises DeployError with the log tails of the parts at fault, leaving nothing running."""
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ)  # KVFERRY_* set by the caller reach every part, as a manifest's env would
    base_env.pop("CUDA_VISIBLE_DEVICES", None)  # --gpus names physical GPUs
    # The repository's packages importable wherever the benchmark is started from (installed or not).
    base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), base_env.get("PYTHONPATH", "")]))
    # Keep the parts' logs readable: Python output unbuffered, so a tail shows the latest lines.
    base_env["PYTHONUNBUFFERED"] = "1"
    deadline = time.monotonic() + spec.ready_timeout_s
    redis_part = _start_redis(spec.log_dir, base_env)
    deployment = Deployment(spec, router_url="", redis=redis_part, workers=[])
    try:
        roles = spec.roles()
        for i, role in enumerate(roles):
            part = _worker(role, i, spec, redis_part.url, base_env)
            part.start()
            deployment.workers.append(part)
        _wait(deployment, deployment.workers, lambda p: get_json(f"{p.url}/ready", 2.0) is not None, deadline, say)

        rport = free_port()
        deployment.router_url = f"http://127.0.0.1:{rport}"
        router_env = dict(base_env)
        router_env.update(
            KVFERRY_HOST="127.0.0.1",
            KVFERRY_PORT=str(rport),
            KVFERRY_MODEL=spec.model,
            KVFERRY_REDIS_URL=redis_part.url,
            KVFERRY_DISCOVERY="static",
            KVFERRY_PREFILL_URLS=",".join(p.url for p, r in zip(deployment.workers, roles) if r == "prefill"),
            KVFERRY_DECODE_URLS=",".join(p.url for p, r in zip(deployment.workers, roles) if r == "decode"),
            KVFERRY_MIXED_URLS=",".join(p.url for p, r in zip(deployment.workers, roles) if r == "mixed"),
            KVFERRY_ROUTER_TOKENIZER=spec.tokenizer_dir,
            KVFERRY_ROUTER_PLACEMENT=spec.placement,
        )
        if spec.gpus:
            # As the k8s router pod runs: one process per CPU of its limit (k8s/base/router.yaml). One process
            # relays a step's tokens to every stream in turn; at ~6k tok/s over ~250 streams that spread alone
            # pushed most requests' ITL p99 past 50 ms while the engine's steps were within it (bench/RESULTS.md).
            router_env.setdefault("KVFERRY_ROUTER_WORKERS", str(K8S_ROUTER_PROCESSES))
        router_env.update(spec.router_env)
        deployment.router = ManagedProcess(
            "router",
            kvferry_argv("router"),
            router_env,
            spec.log_dir / f"{spec.mode}-router.log",
            deployment.router_url,
            cwd=REPO_ROOT,
        )
        deployment.router.start()
        want = {role: roles.count(role) for role in ("prefill", "decode", "mixed")}

        def router_ready(p: ManagedProcess) -> bool:
            # /ready is 200 once one decode worker is up; wait until the router sees every worker.
            body = get_json(f"{p.url}/ready", 2.0)
            return body is not None and body.get("workers") == want

        _wait(deployment, [deployment.router], router_ready, deadline, say)
        return deployment
    except BaseException:
        deployment.stop()
        raise
