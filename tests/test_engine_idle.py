"""An idle worker costs next to no CPU: its engine loop blocks on the command pipe (waking for the load
snapshot once a second) instead of polling it every few milliseconds. Real prefill and decode workers,
after a disaggregated request went through both; each engine publishes its loop turns in /load."""

from __future__ import annotations

import time

import pytest

from tests.helpers import wait_pages_back, wait_until
from tests.workers import WorkerProc, generate, start_worker, wait_ready

pytestmark = pytest.mark.timeout(300)

WINDOW_S = 3.0  # observed idle for this long
MAX_IDLE_TURNS_PER_S = 5.0  # one load snapshot a second, and a few turns around it; polling made ~500


@pytest.fixture(scope="module")
def workers(redis_server):
    p = start_worker("prefill", redis_server)
    d = start_worker("decode", redis_server)
    try:
        wait_ready(p, d)
        yield p, d
    finally:
        p.stop()
        d.stop()


def idle_turns_per_s(w: WorkerProc) -> float:
    first = w.load()["loop_turns"]
    t0 = time.monotonic()
    while time.monotonic() - t0 < WINDOW_S:
        last = w.load()
        assert last["running_requests"] == 0 and last["free_pages"] == last["total_pages"], last
        time.sleep(0.2)
    return (last["loop_turns"] - first) / (time.monotonic() - t0)


def test_idle_engines_block_instead_of_polling(workers, smol_tokenizer):
    p, d = workers
    ids = smol_tokenizer.encode("Write a short story about a lighthouse keeper. " * 12)
    tokens, _ = generate(d, ids, p, max_tokens=4)  # both loops were busy, then went idle
    assert len(tokens) == 4
    wait_pages_back(p, d)
    for w in (p, d):
        assert w.load()["loop_turns"] > 0
        rate = idle_turns_per_s(w)
        assert rate <= MAX_IDLE_TURNS_PER_S, f"{w.role} engine turned {rate:.0f} times a second while idle"
        # Idle past IDLE_TRIM_S, the engine handed its free heap memory back, and says so.
        wait_until(lambda w=w: w.load()["idle_trimmed"], 10, f"the {w.role} engine's idle trim")
    # Blocking does not make it deaf: a request after the idle spell is served at once.
    tokens, _ = generate(d, ids[:40], p, max_tokens=2, timeout=30)
    assert len(tokens) == 2
    wait_pages_back(p, d)
