"""The router's per-worker in-flight counts: derived from the calls holding the worker and reconciled with
the worker's own count of live requests, so a drift cannot lock a worker out with 429s (router/decision/pool.py)."""

from __future__ import annotations

import random
import time

from router.decision.admission import AdmissionLimits, RequestKV, decode_is_full
from router.decision.load import parse_load
from router.decision.pool import RECONCILE_GRACE_S, Worker, WorkerPool


class _Call:
    """Stands for an UpstreamCall in the pool's sets (only its identity matters there)."""

    def kill(self, reason: str) -> None:
        pass

    def prefill_back(self) -> None:
        pass


def _decode_load(live: int | None) -> dict[str, object]:
    snap: dict[str, object] = {
        "role": "decode",
        "pod": "d0",
        "running_requests": 0,
        "waiting_requests": 0,
        "free_pages": 512,
        "total_pages": 512,
        "page_size": 16,
        "ready": True,
        "max_running": 64,
    }
    if live is not None:
        snap["live_requests"] = live
    return snap


def test_calls_the_worker_no_longer_knows_stop_counting_at_its_next_poll() -> None:
    pool = WorkerPool(client=None)  # type: ignore[arg-type]
    pool.set_targets("decode", ["http://d0"])
    w = pool.workers["http://d0"]
    limits = AdmissionLimits(max_waiting=64)
    long_ago = time.monotonic() - 60
    for _ in range(128):  # calls that were never closed: the lock-out of issue 24
        w.decoding[_Call()] = long_ago
    pool.report_load(w, parse_load(_decode_load(live=None)))  # a worker that does not report live requests
    assert w.inflight_requests == 128 and decode_is_full(w, RequestKV(100, 100), limits)
    pool.report_load(w, parse_load(_decode_load(live=0)))  # it has none: the stale calls hold nothing there
    assert w.inflight_requests == 0 and not decode_is_full(w, RequestKV(100, 100), limits)


def test_calls_sent_after_the_poll_count_until_the_worker_can_have_seen_them() -> None:
    pool = WorkerPool(client=None)  # type: ignore[arg-type]
    pool.set_targets("decode", ["http://d0"])
    w = pool.workers["http://d0"]
    pool.report_load(w, parse_load(_decode_load(live=3)), asked=time.monotonic())
    old, new = _Call(), _Call()
    w.decoding[old] = time.monotonic() - 60
    w.decoding[new] = time.monotonic()
    assert w.inflight_requests == 2  # min(mine 2, live 3 + 1 recent)
    del w.decoding[old], w.decoding[new]
    assert w.inflight_requests == 0  # what the router holds is the ceiling
    w.prefilling[new] = (time.monotonic(), 300)
    assert w.inflight_tokens == 300 and w.inflight_requests == 1


def _recount(w: Worker) -> tuple[int, int, int]:
    """(in-flight requests, unseen KV tokens, in-flight prompt tokens) counted from the calls held, by definition."""
    since = w.load_asked - RECONCILE_GRACE_S
    recent = sum(t >= since for t in w.decoding.values()) + sum(t >= since for t, _ in w.prefilling.values())
    mine = len(w.decoding) + len(w.prefilling)
    live = w.load.live_requests if w.load is not None else None
    inflight = mine if live is None else min(mine, live + recent)
    unseen = sum(w.kv_tokens.get(c, 0) for c, t in w.decoding.items() if t >= since)
    return inflight, unseen, sum(n for _, n in w.prefilling.values())


def test_counts_kept_through_holds_releases_and_polls_match_a_recount() -> None:
    pool = WorkerPool(client=None)  # type: ignore[arg-type]
    pool.set_targets("decode", ["http://d0"])
    w = pool.workers["http://d0"]
    rng = random.Random(7)
    now, decoding, prefilling = 1000.0, [], []
    for i in range(3000):
        now += rng.expovariate(20.0)
        op = rng.random()
        if i in (700, 1800):  # a call stamped out of order, held to the end
            w.hold_decode(_Call(), now - 2.5, 100)
        elif op < 0.3:
            call = _Call()
            w.hold_decode(call, now, rng.randint(1, 5000))
            decoding.append(call)
        elif op < 0.45:
            call = _Call()
            w.hold_prefill(call, now, rng.randint(1, 5000))
            prefilling.append(call)
        elif op < 0.65 and decoding:
            w.release_decode(decoding.pop(rng.randrange(len(decoding))))
        elif op < 0.75 and prefilling:
            w.release_prefill(prefilling.pop(rng.randrange(len(prefilling))))
        elif op < 0.8:
            live = rng.choice([None, rng.randint(0, 60)])
            pool.report_load(w, parse_load(_decode_load(live)), asked=now - rng.uniform(0, 0.3))
        assert (w.inflight_requests, w.unseen_kv_tokens, w.inflight_tokens) == _recount(w)
