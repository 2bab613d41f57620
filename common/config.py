"""The workers' and the router's configs, read from the environment (`KVFERRY_*`), with command-line overrides;
every field binds to its declaration in common/settings_registry.py.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from common import settings_registry as reg
from common.internal_auth import InternalToken
from common.prefix.access import RedisAccess
from common.settings import RunnerConfig, SchedulerConfig

ROLE_PORTS = {"router": 8000, "prefill": 8100, "decode": 8200, "mixed": 8300}


def default_max_running(device: str) -> int:
    """Batch slots when KVFERRY_MAX_RUNNING is unset: a GPU decodes hundreds of requests a step at nearly the
    cost of one; a CPU engine's step grows with every request."""
    return 256 if device.startswith("cuda") else 64


@dataclass
class WorkerConfig:
    role: str
    host: str = reg.HOST.field()
    port: int = reg.PORT.field()  # from_env: the role's port when unset
    advertise_url: str = reg.ADVERTISE_URL.field()
    prefill_peers: list[str] = reg.PREFILL_PEERS.field()  # decode/mixed: the only prefill workers it contacts
    pod_name: str = reg.POD_NAME.field()
    redis_url: str = reg.REDIS_URL.field()
    redis_access: RedisAccess = field(default_factory=RedisAccess)  # password, TLS, key prefix
    internal_token: InternalToken = field(default_factory=InternalToken)  # on /internal/* (common/internal_auth.py)
    drain_seconds: float = reg.DRAIN_SECONDS.field()
    relay_allowance: bool = reg.RELAY_ALLOWANCE.field()  # this process's loop lateness added to ITL allowances
    transfer_staging_mb: float = reg.TRANSFER_STAGING_MB.field()  # packing area for peers that split KV heads (TP)
    nixl_progress_delay_us: int = reg.NIXL_PROGRESS_DELAY_US.field()  # -1: the agent's default
    warm_up: str = reg.WARM_UP.field()  # auto | on | off (common/sched/warm_up.py)
    # An engine that died after ready is restarted; this many failed restarts in a row make the worker exit.
    engine_restarts: int = reg.ENGINE_RESTARTS.field()
    engine_start_timeout_s: float = reg.ENGINE_START_TIMEOUT_S.field()
    # One request's KV reservation is at most this share of the pool (published in /load; the router admits by it).
    max_request_kv_share: float = reg.MAX_REQUEST_KV_SHARE.field()
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    sched: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_env(cls, role: str, environ: Mapping[str, str] | None = None) -> WorkerConfig:
        cfg = cls(
            role=role,
            runner=RunnerConfig.from_env(environ),
            sched=SchedulerConfig.from_env(environ),
            redis_access=RedisAccess.from_env(environ),
            internal_token=InternalToken.from_env(environ),
            **reg.read_fields(cls, environ),
        )
        cfg.port = cfg.port or ROLE_PORTS[role]
        cfg.pod_name = cfg.pod_name or f"{socket.gethostname()}-{role}-{cfg.port}"
        if not reg.MAX_RUNNING.is_set(environ) or not cfg.runner.max_running:  # unset or 0: by device
            cfg.runner.max_running = default_max_running(cfg.runner.device)
        return cfg

    def apply_args(self, args: argparse.Namespace) -> WorkerConfig:
        for f in fields(self):
            if f.name not in ("runner", "sched") and getattr(args, f.name, None) is not None:
                setattr(self, f.name, getattr(args, f.name))
        for sub in (self.runner, self.sched):
            for f in fields(sub):
                if getattr(args, f.name, None) is not None:
                    setattr(sub, f.name, getattr(args, f.name))
        if not self.advertise_url:
            host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
            self.advertise_url = f"http://{host}:{self.port}"
        return self


def worker_arg_parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"kvferry {role}", description=f"Run a {role} worker (settings from KVFERRY_* env vars)."
    )
    reg.add_flags(p, WorkerConfig, RunnerConfig, SchedulerConfig)
    return p


@dataclass
class RouterConfig:
    host: str = reg.HOST.field()
    port: int = reg.PORT.field(default=ROLE_PORTS["router"])
    model: str = reg.MODEL.field()
    redis_url: str = reg.REDIS_URL.field()
    discovery: str = reg.DISCOVERY.field()  # static | k8s
    prefill_urls: list[str] = reg.PREFILL_URLS.field()
    decode_urls: list[str] = reg.DECODE_URLS.field()
    mixed_urls: list[str] = reg.MIXED_URLS.field()  # workers that prefill for peers and decode
    namespace: str = reg.NAMESPACE.field()
    api_key: str | None = reg.API_KEY.field()
    redis_access: RedisAccess = field(default_factory=RedisAccess)
    internal_token: InternalToken = field(default_factory=InternalToken)  # sent on every call to a worker
    slo_classes: str = reg.SLO_CLASSES.field()
    slo_default_class: str = reg.SLO_DEFAULT_CLASS.field()
    relay_allowance: bool = reg.RELAY_ALLOWANCE.field()  # this process's loop lateness sent as an ITL allowance

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RouterConfig:
        return cls(
            redis_access=RedisAccess.from_env(environ),
            internal_token=InternalToken.from_env(environ),
            **reg.read_fields(cls, environ),
        )
