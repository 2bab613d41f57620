"""The measured prefill rate and the admission limit it sizes."""

from __future__ import annotations

from common.worker.prefill_rate import PrefillRate
from router.decision.admission import AdmissionLimits, prefill_is_full
from router.decision.load import parse_load
from router.decision.pool import Worker


def test_rate_counts_only_intervals_with_queued_prompts() -> None:
    r = PrefillRate(smoothing=0.5)
    assert r.observe(0.0, 0, busy=False) == 0.0
    assert r.observe(1.0, 0, busy=True) == 0.0  # idle at the interval's start: no sample
    assert r.observe(2.0, 1000, busy=True) == 1000.0  # first sample taken whole
    assert r.observe(3.0, 4000, busy=True) == 2000.0  # 3000 tok/s, smoothed halfway
    assert r.observe(10.0, 4000, busy=False) == 2000.0  # an idle stretch says nothing
    assert r.observe(11.0, 4000, busy=True) == 2000.0


def test_admission_queue_follows_the_measured_rate() -> None:
    limits = AdmissionLimits(max_waiting=64, max_queued_prefill_tokens=1000, queue_seconds=2.0)
    snap = {"role": "prefill", "pod": "p", "queued_prefill_tokens": 30_000, "ready": True}
    slow = Worker("http://p", "prefill", load=parse_load({**snap, "prefill_tokens_per_s": 200.0}))
    fast = Worker("http://q", "prefill", load=parse_load({**snap, "prefill_tokens_per_s": 40_000.0}))
    assert limits.queued_tokens_limit(slow) == 1000  # the floor
    assert limits.queued_tokens_limit(fast) == 80_000  # 2 s of prefill
    assert prefill_is_full(slow, limits) and not prefill_is_full(fast, limits)
