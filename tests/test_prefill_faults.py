"""No 5xx under a prefill fault while any worker can serve (docs/reliability.md): a real cluster (Redis, 2 prefill +
1 decode workers with small pools, the router), a few long prompts at once, and

- kill -9 of one prefill worker's control process mid-prefill (its engine is left to notice by itself), repeated:
  every request completes (200) or gets a 429 with Retry-After, never a status >= 500;
- prefill workers whose engines answer their control calls too late (a busy engine: the fault hook
  KVFERRY_FAULT_ENGINE_CALL_TIMEOUT_S shortens the wait, so the prefill and handshake calls come back 504
  `engine_timeout`): the same, the decode worker prefilling what no prefill worker takes.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest

from common.devcluster.cluster import LocalCluster, start_local_cluster
from tests.helpers import assert_openai_error, load, running_cluster, wait_pages_back, wait_until
from tests.test_reliability import (
    ENV,
    MODEL,
    long_prompt,
    metric,
    part_for,
    restart,
    router_says_up,
    wait_all_up,
    worker_urls,
)

pytestmark = pytest.mark.timeout(600)

PROMPTS = 4
ROUNDS = 3


def _send(c: LocalCluster, prompt: str, out: list[httpx.Response | BaseException]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    try:
        out.append(httpx.post(f"{c.router_url}/v1/completions", json=body, timeout=240))
    except BaseException as e:  # reported to the test thread
        out.append(e)


def _burst(c: LocalCluster, words: int = 700) -> tuple[list[threading.Thread], list[httpx.Response | BaseException]]:
    out: list[httpx.Response | BaseException] = []
    threads = [threading.Thread(target=_send, args=(c, long_prompt(words), out), daemon=True) for _ in range(PROMPTS)]
    for t in threads:
        t.start()
    return threads, out


def _answered_or_429(threads: list[threading.Thread], out: list[httpx.Response | BaseException]) -> list[int]:
    """Each request completed or got a documented 429; never a 5xx (the statuses, for the message)."""
    for t in threads:
        t.join(240)
        assert not t.is_alive(), "a request hung"
    statuses = []
    for r in out:
        assert isinstance(r, httpx.Response), r
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert_openai_error(r.json())
            assert int(r.headers["retry-after"]) >= 1, r.headers
        else:
            assert r.status_code == 200, (r.status_code, r.text)
            assert r.json()["usage"]["completion_tokens"] >= 1
    assert len(statuses) == PROMPTS
    return statuses


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(prefill=2, decode=1, env=ENV) as c:
        yield c


def test_kill9_prefill_control_process_mid_prefill_gives_no_5xx(cluster: LocalCluster) -> None:
    c = cluster
    seen: list[list[int]] = []
    for _ in range(ROUNDS):
        wait_all_up(c)
        wait_pages_back(*worker_urls(c), timeout=60)
        threads, out = _burst(c)
        victim_url = wait_until(
            lambda: next((u for u in c.prefill_urls if load(u)["running_requests"]), None),
            60,
            "a prefill worker mid-prefill",
            interval=0.02,
        )
        victim = part_for(c, victim_url)
        assert victim.proc is not None
        victim.proc.kill()  # the control process only, as `kill -9 <pid>` does; its engine finds itself alone
        seen.append(_answered_or_429(threads, out))
        restart(victim)
    assert any(200 in s for s in seen), seen  # the survivors served, not just refused
    print(f"\nstatuses per round: {seen}")
    wait_all_up(c)
    wait_pages_back(*worker_urls(c), timeout=60)


def test_prefill_engines_answering_too_late_give_no_5xx() -> None:
    # Big prefill steps on the prefill workers (each up to KVFERRY_MAX_STEP_MS) and a control plane that waits
    # far less than a step for its engine: a prefill call that comes while the engine computes is answered 504.
    prefill_env = {"KVFERRY_FAULT_ENGINE_CALL_TIMEOUT_S": "0.05", "KVFERRY_MAX_PREFILL_TOKENS": "512"}
    c = start_local_cluster(prefill=2, decode=1, env=ENV, role_env={"prefill": prefill_env}, ready_timeout_s=300)
    try:
        wait_all_up(c)
        statuses: list[int] = []
        for _ in range(2):
            threads, out = _burst(c)
            statuses += _answered_or_429(threads, out)
        assert 200 in statuses, statuses
        print(f"\nstatuses: {statuses}")
        # Nothing is left held, on the workers that answered late either.
        wait_pages_back(*worker_urls(c), timeout=60)
    finally:
        c.stop()


def _stop_prefill(c: LocalCluster, sig: int) -> None:
    for url in c.prefill_urls:
        part = part_for(c, url)
        assert part.proc is not None
        os.killpg(part.proc.pid, sig)


def test_local_prefill_is_given_back_when_a_prefill_worker_is_back(cluster: LocalCluster) -> None:
    """Every prefill worker frozen (SIGSTOP): the router marks them down and a long prompt is prefilled on the decode
    worker; once they answer again, the prompt (still before its first token) is given back to one of them."""
    c = cluster
    wait_all_up(c)
    done = {u: metric(u, "kvferry_requests_total", '{outcome="done"}') for u in c.prefill_urls}
    _stop_prefill(c, signal.SIGSTOP)
    try:
        wait_until(lambda: not any(router_says_up(c, u) for u in c.prefill_urls), 30, "the prefill workers down")
        out: list[httpx.Response | BaseException] = []
        t = threading.Thread(target=_send, args=(c, long_prompt(1800), out), daemon=True)
        t.start()
        wait_until(lambda: load(c.decode_urls[0])["queued_prefill_tokens"] > 0, 30, "the decode worker prefilling")
    finally:
        _stop_prefill(c, signal.SIGCONT)
    t.join(120)
    assert not t.is_alive() and len(out) == 1
    r = out[0]
    assert isinstance(r, httpx.Response) and r.status_code == 200, (r, getattr(r, "text", ""))
    after = {u: metric(u, "kvferry_requests_total", '{outcome="done"}') for u in c.prefill_urls}
    assert any(after[u] > done[u] for u in c.prefill_urls), "the prompt stayed on the decode worker"
    wait_pages_back(*worker_urls(c), timeout=60)
