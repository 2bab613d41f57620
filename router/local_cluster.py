"""`kvferry up`: the whole system on one machine: redis-server, N prefill and M decode workers, a router.

Every part is a subprocess started the way a pod starts it (``kvferry prefill|decode|router``), on free
ports, logging to files under a temporary directory (printed on failure). ``start_local_cluster`` is the
same thing as a function for tests and benchmarks: it returns the URLs and a ``stop()`` (also usable as
a context manager).

Start order: Redis, then the model is converted once in this process (otherwise N workers would race to
convert it), then the workers (waiting for each one's /ready, with progress), then the router with the
workers' URLs as static lists (waiting for its /ready). Stop order is the reverse: router first (no new
requests), workers (SIGTERM: they drain briefly), Redis last; anything still alive after the grace
period is killed with its process group.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common.net import free_port

__all__ = ["ClusterError", "LocalCluster", "ManagedProcess", "main", "start_local_cluster"]

DEFAULT_MODEL = "smollm2-135m-instruct"
_INSTALL_REDIS = (
    "redis-server is not installed (kvferry up runs one for the prefix index).\n"
    "  Debian/Ubuntu: sudo apt-get install -y redis-server\n"
    "  macOS:         brew install redis\n"
    "or point at a Redis you already run: kvferry up --redis-url redis://HOST:6379/0"
)


class ClusterError(RuntimeError):
    pass


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    url: str | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        try:
            # Own session: Ctrl-C in the terminal reaches only `kvferry up`, which stops the parts in
            # order; and a part's own children (a worker's engine process) can be killed as a group.
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this process leads (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalCluster:
    router_url: str
    prefill_urls: list[str]
    decode_urls: list[str]
    redis_url: str
    log_dir: Path
    router: ManagedProcess | None = None
    workers: list[ManagedProcess] = field(default_factory=list)
    redis: ManagedProcess | None = None
    _stopped: bool = False

    @property
    def parts(self) -> list[ManagedProcess]:
        return [p for p in (self.router, *self.workers, self.redis) if p is not None]

    def stop(self, grace_s: float = 15.0) -> None:
        """Stops everything (idempotent): router, then workers, then Redis; kills what lingers."""
        if self._stopped:
            return
        self._stopped = True
        for group in ([self.router], self.workers, [self.redis]):
            procs = [p for p in group if p is not None]
            for p in procs:
                p.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in procs:
                if p.proc is None:
                    continue
                try:
                    p.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                p.kill_group()

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
            _wait_redis(self.redis, 10.0)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _python_kvferry(*args: str) -> list[str]:
    # `python -m common.cli` is the `kvferry` console script without depending on PATH.
    return [sys.executable, "-m", "common.cli", *args]


def _wait_redis(part: ManagedProcess, timeout_s: float) -> None:
    import redis

    assert part.url is not None
    r = redis.Redis.from_url(part.url, socket_connect_timeout=0.2, socket_timeout=0.5)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if not part.alive():
                raise ClusterError(f"redis-server exited:\n{part.log_tail()}")
            try:
                if r.ping():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"redis-server did not answer within {timeout_s:g}s:\n{part.log_tail()}")
            time.sleep(0.05)
    finally:
        r.close()


def worker_process(
    role: str, port: int, redis_url: str, env: dict[str, str], log_path: Path, name: str = "", args: Sequence[str] = ()
) -> ManagedProcess:
    """A `kvferry prefill|decode` worker on 127.0.0.1:`port` (not started yet)."""
    return ManagedProcess(
        name or role,
        _python_kvferry(role, "--host", "127.0.0.1", "--port", str(port), "--redis-url", redis_url) + list(args),
        env,
        log_path,
        url=f"http://127.0.0.1:{port}",
    )


def wait_ready(
    parts: Sequence[ManagedProcess], timeout_s: float, progress: Callable[[str], None] | None = None
) -> None:
    """Returns once every part answers 200 on /ready; raises ClusterError (with its log tail) when one
    exits or the time runs out."""
    progress = progress or (lambda _msg: None)
    pending = list(parts)
    start = time.monotonic()
    last_note = 0.0
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for p in list(pending):
                if not p.alive():
                    raise ClusterError(f"{p.name} exited during startup (log {p.log_path}):\n{p.log_tail()}")
                try:
                    if client.get(f"{p.url}/ready").status_code == 200:
                        pending.remove(p)
                        progress(f"  {p.name} ready at {p.url} ({time.monotonic() - start:.0f} s)")
                except httpx.HTTPError:
                    pass
            elapsed = time.monotonic() - start
            if pending and elapsed > timeout_s:
                names = ", ".join(p.name for p in pending)
                raise ClusterError(f"not ready after {timeout_s:g}s: {names}\n{pending[0].log_tail()}")
            if pending and elapsed - last_note >= 5.0:
                last_note = elapsed
                progress(f"  waiting for {', '.join(p.name for p in pending)} ({elapsed:.0f} s)")
            if pending:
                time.sleep(0.2)


def start_local_cluster(
    prefill: int = 1,
    decode: int = 1,
    port: int = 0,
    model: str = DEFAULT_MODEL,
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
) -> LocalCluster:
    """Starts Redis (unless ``redis_url`` names one), ``prefill`` + ``decode`` workers and a router;
    returns once all answer /ready. ``port`` 0 picks a free port for the router. ``env`` is added to
    every part's environment (e.g. KVFERRY_NUM_PAGES for small test pools), ``role_env[role]`` to the
    parts of one role ("prefill", "decode", "router"). Raises ClusterError (with the failing part's log
    tail) and leaves nothing running on failure."""
    say = progress or (lambda _msg: None)
    if decode < 1 or prefill < 0:
        raise ClusterError("need at least one decode worker (and zero or more prefill workers)")
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kvferry-up-"))
    logs.mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ)
    base_env.update(env or {})
    base_env["KVFERRY_MODEL"] = model
    base_env.setdefault("KVFERRY_DRAIN_SECONDS", "2")  # local: stop quickly on Ctrl-C
    n_workers = prefill + decode
    base_env.setdefault("KVFERRY_TORCH_THREADS", str(max(1, (os.cpu_count() or 1) // n_workers)))
    if api_key:
        base_env["KVFERRY_API_KEY"] = api_key  # env, not argv: keys do not belong in `ps` output
    else:
        base_env.pop("KVFERRY_API_KEY", None)

    cluster = LocalCluster(
        router_url=f"http://{host}:{port or free_port()}", prefill_urls=[], decode_urls=[], redis_url="", log_dir=logs
    )
    try:
        if redis_url is None:
            binary = shutil.which("redis-server")
            if binary is None:
                raise ClusterError(_INSTALL_REDIS)
            rport = free_port()
            cluster.redis = ManagedProcess(
                "redis",
                [binary, "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                base_env,
                logs / "redis.log",
                url=f"redis://127.0.0.1:{rport}/0",
            )
            cluster.redis.start()
            _wait_redis(cluster.redis, 10.0)
            redis_url = cluster.redis.url
            say(f"redis-server on {redis_url}")
        assert redis_url is not None
        cluster.redis_url = redis_url
        base_env["KVFERRY_REDIS_URL"] = redis_url

        if not model.startswith("dummy:"):  # dummy weights need no files (the router needs a tokenizer dir)
            from common.default_model import resolve_model_path

            say(f"model {model}: {resolve_model_path(model)}")

        for role, count in (("prefill", prefill), ("decode", decode)):
            for i in range(count):
                wport = free_port()
                wenv = dict(base_env, KVFERRY_POD_NAME=f"local-{role}-{i}", **(role_env or {}).get(role, {}))
                part = worker_process(
                    role, wport, redis_url, wenv, logs / f"{role}-{i}.log", name=f"{role}-{i}", args=worker_args
                )
                part.start()
                cluster.workers.append(part)
                (cluster.prefill_urls if role == "prefill" else cluster.decode_urls).append(part.url or "")
        say(f"starting {prefill} prefill + {decode} decode workers (logs in {logs})")
        wait_ready(cluster.workers, ready_timeout_s, say)

        rport_s = cluster.router_url.rsplit(":", 1)[1]
        cluster.router = ManagedProcess(
            "router",
            _python_kvferry(
                "router",
                "--host",
                host,
                "--port",
                rport_s,
                "--model",
                model,
                "--redis-url",
                redis_url,
                "--discovery",
                "static",
                "--prefill-urls",
                ",".join(cluster.prefill_urls),
                "--decode-urls",
                ",".join(cluster.decode_urls),
                *router_args,
            ),
            dict(base_env, **(role_env or {}).get("router", {})),
            logs / "router.log",
            url=cluster.router_url,
        )
        cluster.router.start()
        wait_ready([cluster.router], ready_timeout_s, say)
        return cluster
    except BaseException:
        cluster.stop(grace_s=5.0)
        raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvferry up", description="Run Redis, a router and prefill/decode workers on this machine."
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="router address (0.0.0.0 to serve the network)")
    p.add_argument("--model", default=os.environ.get("KVFERRY_MODEL", DEFAULT_MODEL))
    p.add_argument("--redis-url", help="use this Redis instead of starting redis-server")
    p.add_argument("--api-key", default=os.environ.get("KVFERRY_API_KEY"), help="require this bearer token")
    p.add_argument("--log-dir", help="where the parts write their logs (default: a temp dir)")
    args = p.parse_args(argv)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # SIGTERM behaves like Ctrl-C: unwind through the same stop path.
    def _term(_signo: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    cluster: LocalCluster | None = None
    try:
        say(f"kvferry up: {args.prefill} prefill + {args.decode} decode workers, model {args.model}")
        cluster = start_local_cluster(
            args.prefill,
            args.decode,
            args.port,
            args.model,
            host=args.host,
            redis_url=args.redis_url,
            api_key=args.api_key,
            log_dir=args.log_dir,
            progress=say,
        )
        shown = cluster.router_url.replace("0.0.0.0", "localhost")
        auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
        print(
            f"\nkvferry is up: {shown}/v1  (OpenAI API; Ctrl-C stops everything)\n\n"
            f"curl -s {shown}/v1/chat/completions -H 'content-type: application/json'{auth} \\\n"
            f'  -d \'{{"model": "{args.model}", "messages": [{{"role": "user", "content": '
            f'"What is the capital of France?"}}]}}\'\n',
            flush=True,
        )
        while True:
            time.sleep(1.0)
            for part in cluster.parts:
                if not part.alive():
                    say(f"{part.name} exited unexpectedly (log {part.log_path}):\n{part.log_tail()}")
                    return 1
    except KeyboardInterrupt:
        say("\nstopping...")
        return 0
    except ClusterError as exc:
        say(f"kvferry up failed: {exc}")
        return 1
    finally:
        if cluster is not None:
            try:
                cluster.stop()
            except KeyboardInterrupt:  # a second Ctrl-C: stop waiting, kill every part (and its children)
                say("killing...")
                for part in cluster.parts:
                    part.kill_group()
            say("stopped")
