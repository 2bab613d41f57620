"""Preemption by parking (KVFERRY_PREEMPT_MODE, common/sched/pages.py): a preempted request's KV is copied to the
host KV tier and copied back when pages free up, so nothing is recomputed; where the tier cannot hold it, the
request is recomputed instead. Users see the same tokens as a run that never preempts (greedy and seeded), every
device page and every host page comes back, and /load's counters say which way each preemption went.
"""

from __future__ import annotations

import pytest

from common.engine.runner import ModelRunner, RunnerConfig
from common.protocol import LoadSnapshot, SamplingParams
from common.sched.request import Req
from common.sched.scheduler import Scheduler, SchedulerConfig
from common.worker.worker_metrics import WorkerMetrics
from tests.engine_helpers import story_prompts

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 24
PAGE = 4  # small pages: a short output crosses several page boundaries, so a small pool preempts early
POOL_PAGES = 30  # the four prompts share 29 tokens (7 pages); each grows to ~62 (16 pages): ~43 pages in all
TOPICS = ["the sea", "a small town", "bread", "winter"]


def sampling(i: int) -> SamplingParams:
    """Greedy for even requests, seeded sampling for odd ones."""
    seeded = {"temperature": 0.8, "seed": 100 + i} if i % 2 else {}
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **seeded)


def smol_runner_of(smol_path, num_pages: int) -> ModelRunner:
    return ModelRunner(
        RunnerConfig(model=str(smol_path), page_size=PAGE, num_pages=num_pages, max_running=8, max_seq_len=128)
    )


def run(
    smol_path, prompts: list[list[int]], num_pages: int, mode: str, host_pages: int, reservation: str = "optimistic"
) -> tuple[Scheduler, list[Req], int]:
    """All requests at once through one scheduler; the table and the page ledger checked after every step.
    Returns the scheduler, the requests, and the most host pages parked requests held at once."""
    runner = smol_runner_of(smol_path, num_pages)
    # Half a page over: the tier's size in pages is rounded down from its bytes.
    gb = (host_pages + 0.5) * runner.pool.page_stride_bytes / (1 << 30) if host_pages else 0
    cfg = SchedulerConfig(kv_reservation=reservation, preempt_mode=mode, host_kv_gb=gb)
    sched = Scheduler(runner, cfg)
    reqs = [Req(f"r{i}", list(p), sampling(i)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    most_parked = 0
    while sched.has_work():
        sched.step()
        assert sched.table_violations() == []
        parked = sum(r.parked.host_pages.numel() for r in reqs if r.parked is not None)
        most_parked = max(most_parked, parked)
    return sched, reqs, most_parked


def assert_everything_back(sched: Scheduler) -> None:
    """Every device page free or cached (nothing locked), every table row free, every host page free or cached."""
    cache = sched.cache
    assert cache is not None and cache.protected_pages == 0
    assert sched.allocator.num_free + cache.cached_pages == sched.allocator.num_pages
    assert sched.runner.page_table.num_free_rows == sched.runner.cfg.max_running
    if cache.host is not None:
        assert cache.host.allocator.num_free + cache.host_cached_pages == cache.host.num_pages
    assert not sched.by_id and sched.table_violations() == []


@pytest.fixture(scope="module")
def work(smol_path, smol_tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts, and each one's output from a pool that never runs short (full reservation, no preemption)."""
    prompts = story_prompts(smol_tokenizer, TOPICS)
    sched, reqs, _ = run(smol_path, prompts, 256, "recompute", 0, reservation="full")
    assert sched.table.preemptions == 0
    return prompts, [r.output_ids for r in reqs]


def test_a_parked_request_resumes_with_the_same_tokens_and_nothing_recomputed(smol_path, work) -> None:
    """A pool too small for four requests' outputs: optimistic reservation admits them and preempts as they
    grow. Parked, their KV goes to the host tier and comes back: tokens equal to the unpreempted run's (greedy
    and seeded), no token recomputed, and every parked host page given back on resume (the host ledger, checked
    after every step, counts a resumed request's pages as free or leaked, never as parked)."""
    prompts, expected = work
    sched, reqs, most_parked = run(smol_path, prompts, POOL_PAGES, "park", 64)
    snap = sched.snapshot()
    assert snap.preemptions > 0, "the pool never ran short: the test exercises nothing"
    assert snap.preemptions_parked == snap.preemptions
    assert snap.recomputed_tokens == 0
    assert most_parked > 0
    assert [r.output_ids for r in reqs] == expected
    assert all(r.finish_reason == "length" and r.parked is None for r in reqs)
    assert_everything_back(sched)
    host = sched.cache.host
    assert host is not None and host.saved_pages >= most_parked and host.loaded_pages >= most_parked


def test_without_room_in_the_host_tier_a_preempted_request_is_recomputed(smol_path, work) -> None:
    """The same run with a host tier of one page, less than any request's KV: every preemption falls back to
    recompute (the prompt and outputs so far prefilled again), and the tokens are still the same."""
    prompts, expected = work
    sched, reqs, most_parked = run(smol_path, prompts, POOL_PAGES, "park", 1)
    snap = sched.snapshot()
    assert snap.preemptions > 0 and snap.preemptions_parked == 0 and most_parked == 0
    assert snap.recomputed_tokens > 0
    assert [r.output_ids for r in reqs] == expected
    assert_everything_back(sched)


def test_park_without_a_host_tier_is_refused_at_start(smol_runner) -> None:
    with pytest.raises(ValueError, match="host KV tier"):
        Scheduler(smol_runner, SchedulerConfig(preempt_mode="park", host_kv_gb=0))
    with pytest.raises(ValueError, match="preempt mode"):
        Scheduler(smol_runner, SchedulerConfig(preempt_mode="sometimes", host_kv_gb=0))


def test_metrics_count_preemptions_by_mode_and_recomputed_tokens() -> None:
    """/load's cumulative counters become Prometheus counters that only count increases."""
    m = WorkerMetrics()
    base = {"role": "decode", "pod": "d0", "queued_prefill_tokens": 0, "running_requests": 0}
    base |= {"waiting_requests": 0, "free_pages": 8, "total_pages": 8, "page_size": 16, "ready": True}
    for pre, parked, tokens in ((3, 2, 40), (5, 2, 90), (5, 2, 90)):
        m.observe_load(LoadSnapshot(**base, preemptions=pre, preemptions_parked=parked, recomputed_tokens=tokens))
    assert m.registry.get_sample_value("kvferry_preemptions_total", {"mode": "park"}) == 2
    assert m.registry.get_sample_value("kvferry_preemptions_total", {"mode": "recompute"}) == 3
    assert m.registry.get_sample_value("kvferry_recomputed_tokens_total") == 90
