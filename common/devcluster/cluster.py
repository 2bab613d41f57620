"""Redis, prefill and decode workers and a router on this machine, as one `LocalCluster`.

Start order: Redis, then the model is converted once in this process (otherwise N workers would race to
convert it), then the workers (waiting for each one's /ready, with progress), then the router with the
workers' URLs as static lists (waiting for its /ready). Stop order is the reverse: router first (no new
requests), workers (SIGTERM: they drain briefly), Redis last; anything still alive after the grace
period is killed with its process group. Tests and benchmarks use `start_local_cluster` directly; `kvferry
up` (common/devcluster/up.py) is the same thing as a command.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.default_model import DEFAULT_MODEL_NAME
from common.devcluster.process import ClusterError, ManagedProcess, kvferry_argv, wait_ready, worker_process
from common.devcluster.redis_server import redis_server, wait_redis
from common.net import free_port

__all__ = ["LocalCluster", "start_local_cluster"]


@dataclass
class LocalCluster:
    router_url: str
    prefill_urls: list[str]
    decode_urls: list[str]
    redis_url: str
    log_dir: Path
    mixed_urls: list[str] = field(default_factory=list)
    router: ManagedProcess | None = None
    workers: list[ManagedProcess] = field(default_factory=list)
    redis: ManagedProcess | None = None
    temp_log_dir: bool = False  # made here (no log_dir given): removed on a clean stop
    _stopped: bool = False

    @property
    def parts(self) -> list[ManagedProcess]:
        return [p for p in (self.router, *self.workers, self.redis) if p is not None]

    def stop(self, grace_s: float = 15.0, keep_logs: bool = False) -> None:
        """Stops everything (idempotent): router, then workers, then Redis; kills what lingers. A log directory
        this cluster made goes too, unless ``keep_logs`` (something failed and its logs are the evidence)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._stop_parts(grace_s)
        finally:
            if self.temp_log_dir and not keep_logs:
                shutil.rmtree(self.log_dir, ignore_errors=True)

    def _stop_parts(self, grace_s: float) -> None:
        for group in ([self.router], self.workers, [self.redis]):
            procs = [p for p in group if p is not None]
            for p in procs:
                p.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in procs:
                p.finish(deadline, at_least_s=0.1)

    def stop_redis(self) -> None:
        """Stops the cluster's Redis (tests: routing must carry on without the prefix index)."""
        if self.redis is not None and self.redis.alive():
            self.redis.signal(signal.SIGTERM)
            assert self.redis.proc is not None
            self.redis.proc.wait(10)

    def start_redis(self) -> None:
        """Starts the cluster's Redis again on the same port (empty: workers resync their entries)."""
        if self.redis is not None and not self.redis.alive():
            self.redis.start()
            wait_redis(self.redis, 10.0)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_port_free(host: str, port: int) -> None:
    """Refuses a router port something already listens on: the router could not bind it, and the readiness
    wait would take the other listener for it (a second `kvferry up` reported the first one's URL)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no obstacle
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ClusterError(
                f"port {port} on {host} is in use ({exc.strerror}); choose another with --port"
                ' (make up ARGS="--port N")'
            ) from None


def start_local_cluster(
    prefill: int = 1,
    decode: int = 1,
    port: int = 0,
    model: str = DEFAULT_MODEL_NAME,
    *,
    host: str = "127.0.0.1",
    redis_url: str | None = None,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    role_env: dict[str, dict[str, str]] | None = None,
    worker_args: Sequence[str] = (),
    router_args: Sequence[str] = (),
    log_dir: str | Path | None = None,
    ready_timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
    mixed: int = 0,
) -> LocalCluster:
    """Starts Redis (unless ``redis_url`` names one), ``prefill`` + ``decode`` + ``mixed`` workers and a router
    (placing adaptively, router/decision/cost_model.py, when there are mixed workers and ``KVFERRY_ROUTER_PLACEMENT`` is unset);
    returns once all answer /ready. ``port`` 0 picks a free port for the router. ``env`` is added to
    every part's environment (e.g. KVFERRY_NUM_PAGES for small test pools), ``role_env[role]`` to the
    parts of one role ("prefill", "decode", "mixed", "router"). Raises ClusterError (with the failing part's log
    tail) and leaves nothing running on failure."""
    say = progress or (lambda _msg: None)
    if decode + mixed < 1 or min(prefill, decode, mixed) < 0:
        raise ClusterError("need at least one decode or mixed worker (and zero or more prefill workers)")
    if port:
        _check_port_free(host, port)
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kvferry-up-"))
    logs.mkdir(parents=True, exist_ok=True)
    base_env = _base_env(env, model, api_key, prefill + decode + mixed)
    cluster = LocalCluster(
        router_url="",
        prefill_urls=[],
        decode_urls=[],
        redis_url="",
        log_dir=logs,
        temp_log_dir=not log_dir,
    )
    try:
        if redis_url is None:
            redis_url = _start_redis(cluster, base_env, say)
        cluster.redis_url = redis_url
        base_env["KVFERRY_REDIS_URL"] = redis_url

        if not model.startswith("dummy:"):  # dummy weights need no files (the router needs a tokenizer dir)
            from common.default_model import resolve_model_path

            say(f"model {model}: {resolve_model_path(model)}")

        counts = {"prefill": prefill, "decode": decode, "mixed": mixed}
        _start_workers(cluster, counts, base_env, role_env or {}, worker_args)
        shape = f"{prefill} prefill + {decode} decode" + (f" + {mixed} mixed" if mixed else "")
        say(f"starting {shape} workers (logs in {logs})")
        wait_ready(cluster.workers, ready_timeout_s, say)

        router_env = dict(base_env, **(role_env or {}).get("router", {}))
        if mixed:
            router_env.setdefault("KVFERRY_ROUTER_PLACEMENT", "adaptive")
        start_router(cluster, host, port, model, router_env, router_args, ready_timeout_s, say)
        return cluster
    except BaseException:
        cluster.stop(grace_s=5.0, keep_logs=True)
        raise


def _base_env(env: dict[str, str] | None, model: str, api_key: str | None, n_workers: int) -> dict[str, str]:
    """The environment every part starts from: ours, ``env``, the model and local defaults."""
    base_env = dict(os.environ)
    base_env.update(env or {})
    base_env["KVFERRY_MODEL"] = model
    base_env.setdefault("KVFERRY_DRAIN_SECONDS", "2")  # local: stop quickly on Ctrl-C
    base_env.setdefault("KVFERRY_TORCH_THREADS", str(max(1, (os.cpu_count() or 1) // n_workers)))
    if api_key:
        base_env["KVFERRY_API_KEY"] = api_key  # env, not argv: keys do not belong in `ps` output
    else:
        base_env.pop("KVFERRY_API_KEY", None)
    return base_env


def _start_redis(cluster: LocalCluster, base_env: dict[str, str], say: Callable[[str], None]) -> str:
    """Starts the cluster's own Redis on a free port and returns its URL once it answers."""
    cluster.redis = redis_server(free_port(), cluster.log_dir / "redis.log", base_env)
    cluster.redis.start()
    wait_redis(cluster.redis, 10.0)
    url = cluster.redis.url
    assert url is not None
    say(f"redis-server on {url}")
    return url


def _start_workers(
    cluster: LocalCluster,
    counts: dict[str, int],
    base_env: dict[str, str],
    role_env: dict[str, dict[str, str]],
    worker_args: Sequence[str],
) -> None:
    """Starts ``counts[role]`` workers of each role on distinct free ports (not waiting for them)."""
    urls = {"prefill": cluster.prefill_urls, "decode": cluster.decode_urls, "mixed": cluster.mixed_urls}
    roles = [(r, i) for r, count in counts.items() for i in range(count)]
    ports: dict[tuple[str, int], int] = {}
    while len(set(ports.values())) < len(roles):
        ports = {part: free_port() for part in roles}
    # The prefill workers a decode or mixed worker may ask for remote prefills: this cluster's.
    peers = ",".join(f"http://127.0.0.1:{ports[r]}" for r in roles if r[0] in ("prefill", "mixed"))
    for role, i in roles:
        wenv = dict(base_env, KVFERRY_POD_NAME=f"local-{role}-{i}", KVFERRY_PREFILL_PEERS=peers)
        wenv.update(role_env.get(role, {}))
        log = cluster.log_dir / f"{role}-{i}.log"
        part = worker_process(
            role, ports[(role, i)], cluster.redis_url, wenv, log, name=f"{role}-{i}", args=worker_args
        )
        part.start()
        cluster.workers.append(part)
        urls[role].append(part.url or "")


_PORT_ATTEMPTS = 3


def start_router(
    cluster: LocalCluster,
    host: str,
    port: int,
    model: str,
    router_env: dict[str, str],
    router_args: Sequence[str],
    ready_timeout_s: float,
    say: Callable[[str], None],
) -> None:
    """Starts the router and waits for it. A port picked here (``port`` 0) is free when picked, not when the router
    binds it: another process that takes it first makes the router exit, and a new port is picked."""
    for attempt in range(_PORT_ATTEMPTS):
        cluster.router_url = f"http://{host}:{port or free_port()}"
        cluster.router = _router_process(cluster, host, model, router_env, router_args)
        cluster.router.start()
        try:
            wait_ready([cluster.router], ready_timeout_s, say)
            return
        except ClusterError as e:
            if port or attempt == _PORT_ATTEMPTS - 1 or "address already in use" not in str(e).lower():
                raise
            say(f"router port {cluster.router_url} was taken before it bound it; picking another")
            cluster.router.stop(grace_s=1.0)


def _router_process(
    cluster: LocalCluster, host: str, model: str, router_env: dict[str, str], router_args: Sequence[str]
) -> ManagedProcess:
    """The router, routing to the cluster's workers as static lists."""
    argv = kvferry_argv(
        "router",
        "--host",
        host,
        "--port",
        cluster.router_url.rsplit(":", 1)[1],
        "--model",
        model,
        "--redis-url",
        cluster.redis_url,
        "--discovery",
        "static",
        "--prefill-urls",
        ",".join(cluster.prefill_urls),
        "--decode-urls",
        ",".join(cluster.decode_urls),
        "--mixed-urls",
        ",".join(cluster.mixed_urls),
        *router_args,
    )
    return ManagedProcess("router", argv, router_env, cluster.log_dir / "router.log", url=cluster.router_url)
