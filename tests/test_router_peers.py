"""Other router processes' placements (router/decision/peers.py): a process reads them from the worker's count of
accepted prompt tokens and adds their recent rate to the queue a stale snapshot shows, so two processes predict
a worker's TTFT as one process seeing every placement would."""

from __future__ import annotations

import time

from router.decision.load import parse_load
from router.decision.peers import WINDOW_POLLS, PeerPlacements
from router.decision.policy import RoutingPolicy
from router.decision.pool import SNAPSHOT_LAG_S, WorkerPool
from router.decision.ttft_model import predict_ttft_s
from router.runtime import placement_inputs

RATE = 10_000.0  # the worker's prefill rate, tokens/s: a prediction is then tokens / RATE


def _load(accepted: int | None, queued: int = 0) -> dict[str, object]:
    snap: dict[str, object] = {
        "role": "decode",
        "pod": "d0",
        "queued_prefill_tokens": queued,
        "free_pages": 512,
        "total_pages": 512,
        "ready": True,
        "max_running": 64,
        "prefill_tokens_per_s": RATE,
    }
    if accepted is not None:
        snap["prompt_tokens_accepted"] = accepted
    return snap


def _process() -> tuple[WorkerPool, object]:
    """One router process's view of the worker d0."""
    pool = WorkerPool(client=None)  # type: ignore[arg-type]
    pool.set_targets("decode", ["http://d0"])
    return pool, pool.workers["http://d0"]


def test_rate_is_what_the_worker_accepted_beyond_this_processs_own_placements() -> None:
    p = PeerPlacements()
    # 0.25 s polls; this process places 500 tokens a poll (all uncached), the worker accepts 2,000 a poll
    for i in range(WINDOW_POLLS + 4):
        p.observe(i * 0.25, accepted=2000 * i, placed=500 * i, placed_uncached=500 * i, placements=i)
    assert abs(p.rate - 1500 / 0.25) < 1e-6
    assert p.placed_since(0.1) == 600
    assert p.placed_since(-1.0) == 0


def test_the_others_rate_is_scaled_by_this_processs_uncached_share() -> None:
    p = PeerPlacements()
    for i in range(4):  # half of what this process placed was a prefix hit: the others' likely are too
        p.observe(i * 0.25, accepted=3000 * i, placed=1000 * i, placed_uncached=500 * i, placements=i)
    assert abs(p.rate - 0.5 * 2000 / 0.25) < 1e-6


def test_a_placement_counted_by_the_worker_only_after_the_poll_is_not_taken_for_another_processs() -> None:
    p = PeerPlacements()
    p.observe(0.0, accepted=0, placed=0, placed_uncached=0, placements=0)
    p.observe(0.25, accepted=0, placed=800, placed_uncached=800, placements=1)  # sent just before the poll
    assert p.rate == 0.0
    p.observe(0.5, accepted=800, placed=800, placed_uncached=800, placements=1)  # it arrived: still nobody else's
    assert p.rate == 0.0


def _lone_window(others: int) -> PeerPlacements:
    """A window of 1,000-token placements a poll, two of them still on the way at its first poll; `others`: tokens
    another process placed besides, over the window."""
    p = PeerPlacements()
    p.observe(0.0, accepted=1000, placed=3000, placed_uncached=3000, placements=3)
    for i in range(1, WINDOW_POLLS + 1):
        mine = 3000 + 1000 * i
        p.observe(i * 0.25, accepted=mine + others, placed=mine, placed_uncached=mine, placements=3 + i)
    return p


def test_placements_counted_late_at_the_windows_start_are_not_taken_for_another_processs() -> None:
    """A lone process: its placements reach the worker's count a moment late (a prefill pod's once the decode pod
    reserved the pages). Two of them in flight at the window's first poll and none at its last read as two
    placements the worker accepted beyond this process's own in the window: noise, not another process. Another
    process's four more besides are counted."""
    assert _lone_window(others=0).rate == 0.0
    assert abs(_lone_window(others=4000).rate - 6000 / (WINDOW_POLLS * 0.25)) < 1e-6


def test_a_worker_that_does_not_count_or_restarted_adds_nothing() -> None:
    p = PeerPlacements()
    for i in range(4):  # an older worker: no count on /load, so 0 against this process's placements
        p.observe(i * 0.25, accepted=0, placed=700 * i, placed_uncached=700 * i, placements=i)
    assert p.rate == 0.0
    q = PeerPlacements()
    q.observe(0.0, accepted=50_000, placed=0, placed_uncached=0, placements=0)
    q.observe(0.25, accepted=100, placed=0, placed_uncached=0, placements=0)  # restarted: its count began again
    assert q.rate == 0.0 and q.placed_since(1.0) == 0
    q.observe(0.5, accepted=600, placed=0, placed_uncached=0, placements=0)
    assert abs(q.rate - 500 / 0.25) < 1e-6


def test_two_processes_predict_the_queue_one_process_seeing_every_placement_would() -> None:
    """Process A and process B each place 1,000-token prompts on d0, B four times as often. At a poll, the
    snapshot's queue is what the worker held then; between polls A sees its own placements, and now also B's
    likely ones. A prediction made a moment after the poll includes B's work placed in that moment."""
    pool_a, a = _process()
    pool_b, b = _process()
    poll = 0.25
    t0 = time.monotonic() - (WINDOW_POLLS + 2) * poll
    accepted = 0
    for i in range(WINDOW_POLLS + 2):
        asked = t0 + i * poll
        # in each interval, A placed one prompt and B four: the worker accepted all five by the next poll
        if i:
            a.placed_prompt_tokens += 1000
            a.placed_uncached_tokens += 1000
            b.placed_prompt_tokens += 4000
            b.placed_uncached_tokens += 4000
            accepted += 5000
        pool_a.report_load(a, parse_load(_load(accepted)), asked=asked)
        pool_b.report_load(b, parse_load(_load(accepted)), asked=asked)
    assert abs(a.peers.rate - 4000 / poll) < 1e-6 and abs(b.peers.rate - 1000 / poll) < 1e-6
    # A moment later: the snapshot is (now - last poll) old, plus the snapshot-lag allowance
    now = time.monotonic()
    age = now - a.load_asked + SNAPSHOT_LAG_S
    seen_by_a = a.figures().unseen_tokens
    assert abs(seen_by_a - 16_000 * age) <= 16_000 * 0.05 + 1, (seen_by_a, age)
    # The prediction for a 1,000-token prompt grows by the others' tokens at the worker's rate
    alone = predict_ttft_s(a.figures(), "", 1000)
    assert alone is not None and abs(alone - (1000 + seen_by_a) / RATE) < 1e-9


def test_one_process_alone_adds_only_its_own_placements() -> None:
    pool, w = _process()
    t0 = time.monotonic() - 3.0
    accepted = 0
    for i in range(WINDOW_POLLS + 2):
        if i:
            w.place_prompt(t0 + i * 0.25 - 0.24, 900, 1000)  # its own, early enough for the next poll's snapshot
            accepted += 1000
        pool.report_load(w, parse_load(_load(accepted)), asked=t0 + i * 0.25)
    assert w.peers.rate == 0.0
    # nothing placed since the last poll: the snapshot stands as it is
    assert w.figures().unseen_tokens == 0


class _Call:
    """A decode call as the pool holds it (router/upstream/call.py's, reduced to its identity)."""


def _decode_load(pod: str, running: int, decodes: int) -> dict[str, object]:
    snap = _load(0)
    snap.update(pod=pod, running_requests=running, decodes_accepted=decodes)
    return snap


def test_the_decode_pick_counts_calls_placed_since_the_snapshot() -> None:
    """One of two router processes: the snapshot shows d0 with 2 requests and d1 with 3, and both workers' counts
    show the other process placing there too (three calls a poll). Calls this process places between two polls count
    on the worker they went to, so the third goes to d1; counting only its own calls against the snapshot, all
    three went to d0. The workers may be disaggregated decode pods: no prompt is prefilled there."""
    pool = WorkerPool(client=None)  # type: ignore[arg-type]
    pool.set_targets("decode", ["http://d0", "http://d1"])
    last = time.monotonic() - 0.01
    for url, running in (("http://d0", 2), ("http://d1", 3)):
        w = pool.workers[url]
        w.hold_decode(_Call(), last - 5.0, 1000)  # its own one, long in the worker's count
        for i in range(WINDOW_POLLS + 1):  # the other's three calls a poll
            snap = _decode_load(url[-2:], running, 1 + 3 * i)
            pool.report_load(w, parse_load(snap), asked=last - (WINDOW_POLLS - i) * 0.25)
        assert w.decode_peers.rate > 0 and w.peers.rate == 0.0
    policy = RoutingPolicy()
    picked = []
    for _ in range(3):
        candidates = [w.decode_candidate() for w in pool.workers.values()]
        chosen, _ = policy.pick_decode(1000, 16, 16, candidates, None)
        pool.workers[chosen.key].hold_decode(_Call(), time.monotonic(), 1016)
        picked.append(chosen.key[-2:])
    assert picked[0] == "d0" and "d1" in picked, picked


def test_a_lone_process_picks_on_its_own_calls_as_before() -> None:
    """No other process places here (the worker's count follows this process's calls): the pick counts this
    process's own calls against the snapshot, as it always did, and adds nothing for calls since the poll."""
    pool, w = _process()
    now = time.monotonic()
    w.hold_decode(_Call(), now - 1.0, 1000)
    pool.report_load(w, parse_load(_decode_load("d0", 1, 1)), asked=now - 0.5)
    pool.report_load(w, parse_load(_decode_load("d0", 1, 1)), asked=now - 0.01)
    w.hold_decode(_Call(), time.monotonic(), 1000)
    assert w.decode_peers.rate == 0.0 and w.decode_candidate().waiting == 0


def test_the_decode_pick_counts_the_other_processes_likely_calls() -> None:
    """Another process places calls on d0 at 8 a second: this one counts about 8 x the snapshot's age of them on
    d0's waiting requests."""
    pool, w = _process()
    t0 = time.monotonic() - (WINDOW_POLLS + 2) * 0.25
    accepted = 0
    for i in range(WINDOW_POLLS + 2):
        if i == 1:
            w.hold_decode(_Call(), t0 + 0.01, 1000)  # its own one call, long since in the worker's count
            accepted += 1
        if i:
            accepted += 2  # the other's two a poll
        pool.report_load(w, parse_load(_decode_load("d0", 0, accepted)), asked=t0 + i * 0.25)
    age = time.monotonic() - w.load_asked + SNAPSHOT_LAG_S
    assert abs(w.decode_candidate().waiting - round(8 * age)) <= 1


def test_the_prefill_pick_adds_the_others_likely_tokens_to_the_snapshots_queue() -> None:
    """A prefill pod whose count shows another process placing 4,000 uncached tokens a poll: this process's
    candidate queue is the snapshot's plus what the others likely placed since; alone, the snapshot's as it is."""
    pool = WorkerPool(client=None)  # type: ignore[arg-type]
    pool.set_targets("prefill", ["http://p0"])
    w = pool.workers["http://p0"]
    t0 = time.monotonic() - (WINDOW_POLLS + 2) * 0.25
    accepted = 0
    for i in range(WINDOW_POLLS + 2):
        if i == 1:
            w.place_prompt(t0 + 0.01, 1000, 1000)
            accepted += 1000
        if i:
            accepted += 4000
        snap = _load(accepted, queued=500)
        snap["role"] = "prefill"
        pool.report_load(w, parse_load(snap), asked=t0 + i * 0.25)
    age = time.monotonic() - w.load_asked + SNAPSHOT_LAG_S
    queued = w.prefill_candidate().queued_tokens
    assert abs(queued - (500 + 16_000 * age)) <= 16_000 * 0.05 + 1, (queued, age)
    alone_pool, alone = WorkerPool(client=None), None  # type: ignore[arg-type]
    alone_pool.set_targets("prefill", ["http://p0"])
    alone = alone_pool.workers["http://p0"]
    for i in range(3):
        snap = _load(0, queued=500)
        snap["role"] = "prefill"
        alone_pool.report_load(alone, parse_load(snap), asked=t0 + i * 0.25)
    assert alone.prefill_candidate().queued_tokens == 500


def test_router_workers_shows_what_the_others_are_reckoned_to_place() -> None:
    """`/router/workers` (its placement inputs) shows each worker's estimated rates of the other processes'
    prompt tokens and decode calls, so that a served run can check the estimate against the workers' counts."""
    pool, w = _process()
    t0 = time.monotonic() - (WINDOW_POLLS + 2) * 0.25
    for i in range(WINDOW_POLLS + 1):
        snap = _decode_load("d0", 0, 3 * i)  # the others' three calls a poll ...
        snap["prompt_tokens_accepted"] = 6000 * i  # ... of 2,000 tokens each
        pool.report_load(w, parse_load(snap), asked=t0 + i * 0.25)
    seen = placement_inputs(pool, RoutingPolicy())["workers"]["http://d0"]["others_per_s"]
    assert seen == {"prompt_tokens": 24_000.0, "decodes": 12.0}
