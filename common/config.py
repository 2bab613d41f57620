"""Every setting the apps read from the environment (`KVFERRY_*`), with command-line overrides.

docs/architecture.md lists the same variables; the k8s manifests set only these.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field, fields

from common.internal_auth import InternalToken
from common.prefix.access import RedisAccess
from common.settings import ITL_TARGET_AUTO, RunnerConfig, SchedulerConfig

ROLE_PORTS = {"router": 8000, "prefill": 8100, "decode": 8200, "mixed": 8300}


def default_max_running(device: str) -> int:
    """Batch slots when KVFERRY_MAX_RUNNING is unset: a GPU decodes hundreds of requests per step at nearly
    the cost of one (8B: 4.9 ms at batch 1, 16 ms at 256); a CPU engine's step grows with every request."""
    return 256 if device.startswith("cuda") else 64


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _host_kv_gb(value: str) -> float:
    """KVFERRY_HOST_KV_GB: GiB of host memory for the prefix cache's second tier; `auto` (the default) lets
    the worker choose (common/kv/host_tier.py), 0 turns it off."""
    return -1.0 if value.strip().lower() in ("", "auto") else float(value)


def _itl_target_ms(value: str) -> float:
    """ "auto" (the default: from the engine's measured decode step), milliseconds, or 0 (prefill-first)."""
    if value.strip().lower() == "auto":
        return ITL_TARGET_AUTO
    ms = float(value)
    if ms < 0:
        raise ValueError(f"KVFERRY_ITL_TARGET_MS must be auto, 0 or a positive number of ms, not {value!r}")
    return ms


def _split_urls(value: str) -> list[str]:
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]


@dataclass
class WorkerConfig:
    role: str
    host: str = "0.0.0.0"
    port: int = 0
    advertise_url: str = ""
    pod_name: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_access: RedisAccess = field(default_factory=RedisAccess)  # password, TLS, key prefix
    internal_token: InternalToken = field(default_factory=InternalToken)  # on /internal/* (common/internal_auth.py)
    drain_seconds: float = 25.0
    transfer_staging_mb: float = 256.0  # packing area for peers that split KV heads differently (TP)
    nixl_progress_delay_us: int = -1  # -1: the agent's default (100 us for CPU pools, 0 for GPU pools)
    # An engine that died after it was ready is started again by its control plane; this many restarts in a
    # row that fail (die before ready, or not ready within engine_start_timeout_s) make the worker exit.
    engine_restarts: int = 3
    engine_start_timeout_s: float = 600.0
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    sched: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_env(cls, role: str) -> WorkerConfig:
        port = int(_env("KVFERRY_PORT", str(ROLE_PORTS[role])))
        pod = _env("KVFERRY_POD_NAME", f"{socket.gethostname()}-{role}-{port}")
        device = _env("KVFERRY_DEVICE", "cpu")
        return cls(
            role=role,
            host=_env("KVFERRY_HOST", "0.0.0.0"),
            port=port,
            advertise_url=_env("KVFERRY_ADVERTISE_URL", ""),
            pod_name=pod,
            redis_url=_env("KVFERRY_REDIS_URL", "redis://127.0.0.1:6379/0"),
            redis_access=RedisAccess.from_env(),
            internal_token=InternalToken.from_env(),
            drain_seconds=float(_env("KVFERRY_DRAIN_SECONDS", "25")),
            transfer_staging_mb=float(_env("KVFERRY_TRANSFER_STAGING_MB", "256")),
            nixl_progress_delay_us=int(_env("KVFERRY_NIXL_PROGRESS_DELAY_US", "-1")),
            engine_restarts=int(_env("KVFERRY_ENGINE_RESTARTS", "3")),
            engine_start_timeout_s=float(_env("KVFERRY_ENGINE_START_TIMEOUT_S", "600")),
            runner=RunnerConfig(
                model=_env("KVFERRY_MODEL", "smollm2-135m-instruct"),
                device=device,
                dtype=_env("KVFERRY_DTYPE", "auto"),  # auto: float32 on CPU, bfloat16 on GPU
                page_size=int(_env("KVFERRY_PAGE_SIZE", "16")),
                num_pages=int(_env("KVFERRY_NUM_PAGES", "0")),
                kv_memory_gb=float(_env("KVFERRY_KV_MEMORY_GB", "0")),
                max_running=int(_env("KVFERRY_MAX_RUNNING", "0")) or default_max_running(device),
                tp_size=int(_env("KVFERRY_TP_SIZE", "1")),
                tp_transfer=_env("KVFERRY_TP_TRANSFER", "auto"),
                decode_tc_min_batch=int(_env("KVFERRY_DECODE_TC_MIN_BS", "1")),
                fused_kernels=_env("KVFERRY_FUSED_KERNELS", "1") not in ("0", "off", "false"),
                gemv_max_rows=int(_env("KVFERRY_GEMV_MAX_ROWS", "8")),
            ),
            sched=SchedulerConfig(
                max_prefill_tokens=int(_env("KVFERRY_MAX_PREFILL_TOKENS", "2048")),
                itl_target_ms=_itl_target_ms(_env("KVFERRY_ITL_TARGET_MS", "auto")),
                host_kv_gb=_host_kv_gb(_env("KVFERRY_HOST_KV_GB", "auto")),
                overlap=_env("KVFERRY_OVERLAP", "auto"),
            ),
        )

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
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--advertise-url", dest="advertise_url")
    p.add_argument("--pod-name", dest="pod_name")
    p.add_argument("--redis-url", dest="redis_url")
    p.add_argument("--model")
    p.add_argument("--device")
    p.add_argument("--page-size", dest="page_size", type=int)
    p.add_argument("--num-pages", dest="num_pages", type=int)
    p.add_argument("--kv-memory-gb", dest="kv_memory_gb", type=float)
    p.add_argument("--max-running", dest="max_running", type=int)
    p.add_argument("--max-prefill-tokens", dest="max_prefill_tokens", type=int)
    p.add_argument("--host-kv-gb", dest="host_kv_gb", type=float, help="host-memory prefix tier (GiB, 0: off)")
    p.add_argument("--tp-size", dest="tp_size", type=int, help="tensor-parallel ranks (one process each)")
    return p


@dataclass
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    model: str = "smollm2-135m-instruct"
    redis_url: str = "redis://127.0.0.1:6379/0"
    discovery: str = "static"  # static | k8s
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    mixed_urls: list[str] = field(default_factory=list)  # workers that prefill for peers and decode
    namespace: str = ""
    api_key: str | None = None
    redis_access: RedisAccess = field(default_factory=RedisAccess)
    internal_token: InternalToken = field(default_factory=InternalToken)  # sent on every call to a worker

    @classmethod
    def from_env(cls) -> RouterConfig:
        return cls(
            host=_env("KVFERRY_HOST", "0.0.0.0"),
            port=int(_env("KVFERRY_PORT", "8000")),
            model=_env("KVFERRY_MODEL", "smollm2-135m-instruct"),
            redis_url=_env("KVFERRY_REDIS_URL", "redis://127.0.0.1:6379/0"),
            discovery=_env("KVFERRY_DISCOVERY", "static"),
            prefill_urls=_split_urls(_env("KVFERRY_PREFILL_URLS", "")),
            decode_urls=_split_urls(_env("KVFERRY_DECODE_URLS", "")),
            mixed_urls=_split_urls(_env("KVFERRY_MIXED_URLS", "")),
            namespace=_env("KVFERRY_NAMESPACE", ""),
            api_key=os.environ.get("KVFERRY_API_KEY") or None,
            redis_access=RedisAccess.from_env(),
            internal_token=InternalToken.from_env(),
        )
