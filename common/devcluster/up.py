"""`kvferry up` (and `make up`): the whole system on this machine until Ctrl-C, with a request to try and the
answer the system gave it. A part that exits is restarted with back-off (common/devcluster/supervisor.py) while
the others keep serving."""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys
import time
import urllib.request
from collections.abc import Callable

from common.devcluster.cluster import LocalCluster, start_local_cluster
from common.devcluster.process import ClusterError
from common.devcluster.supervisor import Supervisor
from common.settings_registry import API_KEY, INTERNAL_TOKEN, MODEL, REDIS_PASSWORD

__all__ = ["main"]

TRY_QUESTION = "What is the capital of France?"
FIRST_ANSWER_TIMEOUT_S = 120.0  # a CPU worker's first request warms it up


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # SIGTERM behaves like Ctrl-C: unwind through the same stop path.
    def _term(_signo: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    cluster: LocalCluster | None = None
    supervisor: Supervisor | None = None
    try:
        mixed = f" + {args.mixed} mixed" if args.mixed else ""
        say(f"kvferry up: {args.prefill} prefill + {args.decode} decode{mixed} workers, model {args.model}")
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
            mixed=args.mixed,
            env=_secrets_env(args.redis_url),
        )
        _print_try_request(cluster, args)
        supervisor = Supervisor(cluster.parts, say)
        while True:
            time.sleep(0.5)
            supervisor.check()
    except KeyboardInterrupt:
        say("\nstopping...")
        return 0
    except ClusterError as exc:
        say(f"kvferry up failed: {exc}")
        return 1
    finally:
        if cluster is not None:
            _stop(cluster, supervisor, say)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvferry up", description="Run Redis, a router and prefill/decode workers on this machine."
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--mixed", type=int, default=0, help="mixed workers: decode, and prefill for peers (default 0)")
    p.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="router address (0.0.0.0 to serve the network)")
    p.add_argument("--model", default=MODEL.read())
    p.add_argument("--redis-url", help="use this Redis instead of starting redis-server")
    p.add_argument("--api-key", default=API_KEY.read(), help="require this bearer token")
    p.add_argument(
        "--log-dir",
        help="where the parts write their logs (default: a temp dir, removed on a clean stop and kept when a part failed)",
    )
    return p.parse_args(argv)


def _secrets_env(redis_url: str | None) -> dict[str, str]:
    """The workers' internal API is closed to other users of this machine too: a token made for this run
    (unless one is set), given to every part in its environment and never printed."""
    token = ",".join(INTERNAL_TOKEN.read()) or secrets.token_urlsafe(32)
    secrets_env = {INTERNAL_TOKEN.name: token}
    if redis_url is None:
        # The prefix index's Redis likewise: other local users could read it, steer placement with fake
        # entries, or flush it. The password reaches redis-server in a 0600 file, the parts in their env.
        secrets_env[REDIS_PASSWORD.name] = REDIS_PASSWORD.read() or secrets.token_urlsafe(32)
    return secrets_env


def _print_try_request(cluster: LocalCluster, args: argparse.Namespace) -> None:
    """The request to try, sent once first so the user sees the system answer it (greedy: the right answer)."""
    shown = cluster.router_url.replace("0.0.0.0", "localhost")
    body = {"model": args.model, "temperature": 0, "messages": [{"role": "user", "content": TRY_QUESTION}]}
    answer = _first_answer(f"{shown}/v1/chat/completions", body, args.api_key)
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    print(
        f"\nkvferry is up: {shown}/v1  (OpenAI API; Ctrl-C stops everything)\n\n"
        f"curl -s {shown}/v1/chat/completions -H 'content-type: application/json'{auth} \\\n"
        f"  -d '{json.dumps(body)}'\n"
        f"{answer}\n",
        flush=True,
    )


def _first_answer(url: str, body: dict[str, object], api_key: str | None) -> str:
    """What the router answers to `body`, as one line for the terminal (a failure is said, not raised: the
    system keeps running and the user can look)."""
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=FIRST_ANSWER_TIMEOUT_S) as resp:
            content = json.loads(resp.read())["choices"][0]["message"]["content"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        return f"-> the first request failed: {exc}"
    return f"-> {json.dumps(content)}  (answered in {time.monotonic() - started:.1f} s)"


def _stop(cluster: LocalCluster, supervisor: Supervisor | None, say: Callable[[str], None]) -> None:
    """Stops every part; logs are kept when a part had to be restarted during the run."""
    restarted = sorted(name for name, n in (supervisor.restarts if supervisor else {}).items() if n)
    try:
        cluster.stop(keep_logs=bool(restarted))
        if restarted and cluster.temp_log_dir:
            say(f"logs kept in {cluster.log_dir} ({', '.join(restarted)} restarted during the run)")
    except KeyboardInterrupt:  # a second Ctrl-C: stop waiting, kill every part (and its children)
        say("killing...")
        for part in cluster.parts:
            part.kill_group()
    say("stopped")
