"""The prefix cache's host-memory tier: eviction to the host, loads back, LRU across tiers, exact ledgers in both
tiers, the same outputs as a cold run, and the tier recorded in the Redis prefix index.

Unit tests drive the radix cache over real (small) KV pools; the engine test runs a tiny random model with a
device pool far smaller than its prefixes; the worker test serves the packaged SmolLM2 over real HTTP and Redis.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import httpx
import pytest
import redis
import torch

from common.engine.runner import ModelRunner, RunnerConfig
from common.kv.allocator import PageAllocator
from common.kv.host_tier import HostTier, page_runs, within_pieces
from common.kv.integrity import page_ledger_violations
from common.kv.pool import KVLayout, KVPool
from common.kv.radix import RadixCache
from common.offline import Engine
from common.prefix.hashing import chained_block_hashes
from common.prefix.publisher import PrefixIndexPublisher
from common.prefix.reader import PrefixIndexReader
from common.prefix.scripts import IndexKeys
from common.protocol import SamplingParams
from common.settings import SchedulerConfig
from router.decision.locality import saved_blocks
from tests.engine_helpers import assert_pool_clean, fresh_engine
from tests.helpers import pages_back, wait_pages_back, wait_until
from tests.test_scheduler import PAGE, prompts
from tests.workers import WorkerProc, generate, start_worker, wait_ready

PS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, page_size=PS, dtype=torch.float32)


class Tiers:
    """A device pool, a host tier and a radix cache over them; a page's KV is a value derived from its tokens,
    so a page copied to the wrong place, or not at all, shows."""

    def __init__(self, device_pages: int, host_pages: int) -> None:
        self.pool = KVPool(LAYOUT, device_pages)
        self.alloc = PageAllocator(device_pages)
        self.host = HostTier(self.pool, host_pages)
        self.cache = RadixCache(PS, self.alloc, self.host)

    @staticmethod
    def value(tokens: list[int], page: int) -> float:
        return float(sum(tokens[: (page + 1) * PS]) % 100_003 + page)

    def add(self, tokens: list[int]) -> None:
        """What the scheduler does for a finished prompt: pages for it (evicting), KV written, cached."""
        n = len(tokens) // PS
        if n > self.alloc.num_free:
            self.cache.evict(n - self.alloc.num_free)
        pages = self.alloc.alloc(n)
        assert pages is not None
        for i, p in enumerate(pages.tolist()):
            self.pool.kv[p] = self.value(tokens, i)
        hashes = chained_block_hashes(tokens, PS)
        self.cache.insert(tokens, pages, hashes)
        tree = self.cache.match_prefix(tokens).pages
        dup = pages != tree
        self.alloc.free(pages[dup])

    def fetch(self, tokens: list[int]) -> int:
        """Matches and loads back; checks the KV of every matched page; returns the matched length."""
        m = self.cache.load_back(self.cache.match_prefix(tokens))
        for i, p in enumerate(m.pages.tolist()):
            assert bool((self.pool.kv[p] == self.value(tokens, i)).all()), f"page {i} of the prefix is wrong"
        return m.matched_len

    def check(self) -> None:
        assert page_ledger_violations(self.alloc, self.cache, []) == []
        assert self.alloc.num_free + self.cache.cached_pages == self.alloc.num_pages
        assert self.host.allocator.num_free + self.cache.host_cached_pages == self.host.num_pages


def seq(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def test_page_runs_coalesce_consecutive_pages() -> None:
    assert page_runs([3, 4, 5, 9, 10], [0, 1, 2, 3, 7]) == [(3, 0, 3), (9, 3, 1), (10, 7, 1)]
    assert page_runs([], []) == []


def test_copies_stay_within_one_locked_piece_of_the_host_side(monkeypatch) -> None:
    """CUDA refuses a copy from or to page-locked memory that spans two registrations ("invalid argument"): a
    tier locked in pieces cuts its copies where the host side passes from one piece into the next, on whole
    pages, and the cut runs still cover every page in order."""
    assert within_pieces([(0, 3, 6)], 4, host_is_dst=True) == [(0, 3, 1), (1, 4, 4), (5, 8, 1)]
    assert within_pieces([(3, 0, 6)], 4, host_is_dst=False) == [(3, 0, 1), (4, 1, 4), (8, 5, 1)]
    assert within_pieces([(0, 0, 4), (9, 4, 2)], 4, host_is_dst=True) == [(0, 0, 4), (9, 4, 2)]
    import common.kv.host_tier as host_tier

    pool = KVPool(LAYOUT, 8)
    stride = pool.page_stride_bytes
    monkeypatch.setattr(host_tier, "LOCK_CHUNK_BYTES", 3 * stride + stride // 2)  # not a whole number of pages
    monkeypatch.setattr(host_tier, "HOST_PAGE_BYTES", stride // 2)
    per_piece = 3
    pieces: list[tuple[int, int]] = []
    tier = HostTier(pool, 20, lock_pages=lambda address, nbytes: pieces.append((address, nbytes)) or True)
    tier.lock_some(float("inf"))
    assert all(n % stride == 0 for _, n in pieces)  # whole pages
    base = tier.pool.kv.data_ptr()

    def piece_of(page: int) -> int:
        address = base + page * stride
        return next(i for i, (a, n) in enumerate(pieces) if a <= address < a + n)

    rng = random.Random(7)
    for _ in range(50):
        n = rng.randrange(1, 8)
        host = list(range(h := rng.randrange(0, 20 - n), h + n))
        device = list(range(d := rng.randrange(0, 8 - n + 1), d + n))
        for host_is_dst, (src, dst) in ((True, (device, host)), (False, (host, device))):
            runs = tier.copy_runs(src, dst, host_is_dst)
            assert [p for s, _, k in runs for p in range(s, s + k)] == src
            assert [p for _, d2, k in runs for p in range(d2, d2 + k)] == dst
            for s, d2, k in runs:
                first = d2 if host_is_dst else s
                assert piece_of(first) == piece_of(first + k - 1)
    assert len(pieces) == -(-20 // per_piece) and sum(n for _, n in pieces) == 20 * stride
    assert HostTier(pool, 20).copy_runs(list(range(8)), list(range(8)), True) == [(0, 0, 8)]  # CPU: nothing cut
    # pieces are whole OS pages too: with 3 KV pages to 2 OS pages, pieces of 2 KV pages would split one
    monkeypatch.setattr(host_tier, "HOST_PAGE_BYTES", 3 * stride // 2)
    monkeypatch.setattr(host_tier, "LOCK_CHUNK_BYTES", 2 * stride)
    odd: list[tuple[int, int]] = []
    HostTier(pool, 20, lock_pages=lambda address, nbytes: odd.append((address, nbytes)) or True).lock_some(1e9)
    assert {n for _, n in odd[:-1]} == {3 * stride}


def test_evicted_prefix_goes_to_host_and_comes_back_intact() -> None:
    t = Tiers(device_pages=8, host_pages=16)
    a, b = seq(1, 4 * PS), seq(2, 4 * PS)
    t.add(a)
    t.add(b)
    assert t.cache.drain_index_events() == []
    t.add(seq(3, 4 * PS))  # needs 4 pages: `a`, least recently used, moves to the host
    assert t.cache.drain_index_events() == [("host", chained_block_hashes(a, PS))]
    assert t.cache.host_cached_pages == 4 and t.host.saved_pages == 4
    m = t.cache.match_prefix(a)
    assert (m.matched_len, m.host_len, len(m.host_nodes)) == (0, 4 * PS, 1)
    t.check()
    assert t.fetch(a) == 4 * PS  # loaded back (evicting `b` to the host for room), KV intact
    assert t.host.loaded_pages == 4 and t.cache.host_cached_pages == 4
    events = t.cache.drain_index_events()
    assert events == [("host", chained_block_hashes(b, PS)), ("device", chained_block_hashes(a, PS))]
    t.check()
    assert t.fetch(b) == 4 * PS
    t.check()


def test_a_tier_still_being_page_locked_is_not_used_until_every_piece_is(monkeypatch) -> None:
    """On a GPU the tier is page-locked after the engine starts, a piece per idle turn (`lock_some`): until then
    the cache runs as if it had no tier (an evicted prefix is dropped, nothing parks there), after it the tier
    takes evictions; a piece that fails to lock ends the locking and the tier serves unlocked (copies stay
    correct, only not overlapped). The lock function is the CUDA boundary (cudaHostRegister on a GPU): here it
    records the pieces it is given."""
    import common.kv.host_tier as host_tier

    monkeypatch.setattr(host_tier, "LOCK_CHUNK_BYTES", 256)
    monkeypatch.setattr(host_tier, "HOST_PAGE_BYTES", 128)  # one KV page of LAYOUT: pieces of 2 pages
    pool = KVPool(LAYOUT, 8)
    locked: list[tuple[int, int]] = []
    tier = HostTier(pool, 16, lock_pages=lambda address, nbytes: locked.append((address, nbytes)) or True)
    nbytes = tier.pool.kv.numel() * tier.pool.kv.element_size()
    pieces = -(-nbytes // 256)
    assert pieces > 2 and not tier.ready
    t = Tiers.__new__(Tiers)
    t.pool, t.alloc, t.host = pool, PageAllocator(8), tier
    t.cache = RadixCache(PS, t.alloc, tier)
    a, b = seq(1, 4 * PS), seq(2, 4 * PS)
    t.add(a)
    t.add(b)
    t.add(seq(3, 4 * PS))  # evicts `a`: dropped, not moved to a tier not yet locked
    assert t.cache.host_cached_pages == 0 and tier.saved_pages == 0
    assert t.cache.match_prefix(a).host_len == 0 and t.cache.take_host_pages(2) is None
    t.check()
    assert tier.unlocked_pages == 16  # /load's host_pages_locked: 0 of 16
    assert tier.lock_some(budget_s=0.0) and len(locked) == 1 and not tier.ready  # one piece per call at least
    assert tier.unlocked_pages == 14  # a piece of 2 pages locked
    while tier.lock_some(budget_s=0.0):
        pass
    assert tier.ready and len(locked) == pieces and tier.unlocked_pages == 0
    assert [addr for addr, _ in locked] == [tier.pool.kv.data_ptr() + 256 * i for i in range(pieces)]
    assert sum(n for _, n in locked) == nbytes
    t.add(seq(4, 4 * PS))  # evicts `b`: now to the host, and back intact
    assert t.cache.host_cached_pages == 4 and tier.saved_pages == 4
    assert t.fetch(b) == 4 * PS
    t.check()
    calls = []
    failing = HostTier(pool, 16, lock_pages=lambda address, nbytes: calls.append(address) and False)
    assert not failing.lock_some(budget_s=1.0) and failing.ready and len(calls) == 1
    assert HostTier(pool, 16).ready and HostTier(pool, 16).unlocked_pages == 0  # on the CPU nothing needs locking


def test_page_locking_stops_between_pieces_once_a_command_is_waiting(monkeypatch) -> None:
    """The engine loop locks the tier in its idle turns and passes `waiting` (its command pipe has data): a turn
    locks at least one piece, and no more once a command came in, so a request arriving meanwhile waits for the
    piece under way only; with nothing waiting, a turn goes on until its budget is spent."""
    import common.kv.host_tier as host_tier

    monkeypatch.setattr(host_tier, "LOCK_CHUNK_BYTES", 256)
    monkeypatch.setattr(host_tier, "HOST_PAGE_BYTES", 128)  # pieces of 2 KV pages
    locked: list[int] = []
    tier = HostTier(KVPool(LAYOUT, 8), 32, lock_pages=lambda address, nbytes: locked.append(address) or True)
    assert tier.lock_some(float("inf"), waiting=lambda: True) and len(locked) == 1  # at least one piece
    assert tier.lock_some(float("inf"), waiting=lambda: len(locked) >= 3) and len(locked) == 3
    assert not tier.lock_some(float("inf"), waiting=lambda: False) and tier.ready  # nothing waiting: all the rest
    assert len(locked) == len(set(locked)) == 16 and tier.unlocked_pages == 0


def test_parked_pages_displace_the_oldest_cached_prefixes_and_the_ledger_counts_them() -> None:
    """A preempted request parks its KV in host pages taken from the tier's cached prefixes, least recently used
    first (common/sched/pages.py); the ledger counts them (free + cached + parked == total) and catches a parked
    page that is also free. More pages than the tier holds: None, nothing dropped."""
    t = Tiers(device_pages=8, host_pages=8)
    a, b = seq(1, 4 * PS), seq(2, 4 * PS)
    t.add(a)
    t.add(b)
    t.cache.evict(8)  # both prefixes to the host: the tier is full
    t.cache.match_prefix(b)  # `b` used since: `a` is the older
    assert t.host.allocator.num_free == 0 and t.cache.host_cached_pages == 8
    assert t.cache.take_host_pages(9) is None and t.cache.host_cached_pages == 8
    parked = t.cache.take_host_pages(3)
    assert parked is not None and parked.numel() == 3
    assert t.cache.match_prefix(a).host_len == 0 and t.cache.match_prefix(b).host_len == 4 * PS
    assert page_ledger_violations(t.alloc, t.cache, [], [parked]) == []
    assert page_ledger_violations(t.alloc, t.cache, []) != []  # the parked pages, unaccounted for
    t.host.allocator.free(parked[:1])
    assert page_ledger_violations(t.alloc, t.cache, [], [parked]) != []  # a parked page also free
    t.host.allocator.free(parked[1:])
    t.check()


def test_partial_host_match_splits_and_loads_only_the_shared_pages() -> None:
    t = Tiers(device_pages=8, host_pages=16)
    a = seq(1, 6 * PS)
    t.add(a)
    t.cache.evict(6)
    assert t.cache.host_cached_pages == 6
    probe = a[: 2 * PS] + seq(9, 3 * PS)
    assert t.fetch(probe) == 2 * PS
    assert t.cache.cached_pages == 2 and t.cache.host_cached_pages == 4
    assert t.fetch(a) == 6 * PS  # the rest of it, below the part now on the device
    t.check()


def test_lru_across_tiers() -> None:
    t = Tiers(device_pages=4, host_pages=4)
    a, b, c = seq(1, 4 * PS), seq(2, 4 * PS), seq(3, 4 * PS)
    t.add(a)
    t.add(b)  # a -> host
    t.add(c)  # b -> host, and a (older than b) leaves the host tier for it
    assert t.cache.match_prefix(a).host_len == 0 and t.cache.match_prefix(a).matched_len == 0
    assert t.cache.match_prefix(b).host_len == 4 * PS  # (this match refreshes b: newer than c now)
    t.add(seq(4, 4 * PS))  # c, older than everything on the host, is dropped rather than pushing b out
    assert t.cache.match_prefix(c).host_len == 0
    assert t.cache.match_prefix(b).host_len == 4 * PS
    events = t.cache.drain_index_events()
    assert (None, chained_block_hashes(a, PS)) in events and (None, chained_block_hashes(c, PS)) in events
    t.check()


def test_insert_over_a_host_node_adopts_the_new_device_pages() -> None:
    t = Tiers(device_pages=8, host_pages=8)
    a = seq(1, 4 * PS)
    t.add(a)
    t.cache.evict(4)
    t.cache.drain_index_events()
    t.add(a)  # recomputed elsewhere (a request that matched before the move): its pages replace the host copy
    assert t.cache.host_cached_pages == 0 and t.cache.cached_pages == 4
    assert t.cache.drain_index_events() == [("device", chained_block_hashes(a, PS))]
    assert t.fetch(a) == 4 * PS
    t.check()


def test_locked_prefix_stays_and_a_lock_on_the_host_is_refused() -> None:
    t = Tiers(device_pages=8, host_pages=8)
    a, b = seq(1, 4 * PS), seq(2, 4 * PS)
    t.add(a)
    m = t.cache.match_prefix(a)
    t.cache.lock(m.node)
    t.add(b)
    t.add(seq(3, 4 * PS))  # only b can make room
    assert t.cache.match_prefix(a).matched_len == 4 * PS
    hm = t.cache.match_prefix(b)
    with pytest.raises(RuntimeError, match="host tier"):
        t.cache.lock(hm.host_nodes[0])
    t.cache.unlock(m.node)
    t.check()


def test_random_operations_keep_both_ledgers_exact() -> None:
    rng = random.Random(7)
    t = Tiers(device_pages=24, host_pages=20)
    docs = [seq(100 + i, rng.randrange(2, 7) * PS) for i in range(10)]
    for _ in range(400):
        doc = rng.choice(docs)
        # A prompt sharing a random number of the document's pages, then its own tail.
        prompt = doc[: rng.randrange(1, len(doc) // PS + 1) * PS] + seq(rng.randrange(10**6), rng.randrange(0, 3) * PS)
        op = rng.random()
        if op < 0.5:
            t.add(prompt)
        elif op < 0.9:
            t.fetch(prompt)
        else:
            t.cache.evict(rng.randrange(1, 8))
        t.check()
    events = t.cache.drain_index_events()
    assert {tier for tier, _ in events} <= {"device", "host", None}
    t.cache.reset()
    assert t.alloc.num_free == 24 and t.host.allocator.num_free == 20


# ---- the engine: prefixes that outgrow the device pool ------------------------------------------------------


def tier_engine(model, num_pages: int, host_pages: int, prefix_cache: bool = True) -> Engine:
    runner = ModelRunner(RunnerConfig(page_size=PAGE, num_pages=num_pages, max_running=4, max_seq_len=512), model=model)
    gb = host_pages * runner.pool.page_stride_bytes / (1 << 30)
    cfg = SchedulerConfig(max_prefill_tokens=64, enable_prefix_cache=prefix_cache, host_kv_gb=gb)
    return Engine(runner=runner, sched_cfg=cfg, load_tokenizer=False)


def test_second_round_reuses_prefixes_from_the_host_tier(tiny_model) -> None:  # noqa: F811
    docs = prompts(11, [10 * PAGE] * 12)  # 120 pages of documents; the device pool holds 40 pages
    questions = prompts(12, [20] * 24)
    first = [d + questions[i] for i, d in enumerate(docs)]
    second = [d + questions[12 + i] for i, d in enumerate(docs)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    cold = tier_engine(tiny_model, num_pages=256, host_pages=0, prefix_cache=False)
    expected = [r.output_ids for r in cold.generate(second, sp)]

    cached: dict[str, list[float]] = {}
    for name, host_pages in (("tier", 200), ("no tier", 0)):
        engine = tier_engine(tiny_model, num_pages=40, host_pages=host_pages)
        sched = engine.scheduler
        assert (sched.cache.host is None) == (host_pages == 0)
        for i in range(0, len(first), 2):  # two at a time, documents interleaved
            engine.generate(first[i : i + 2], sp)
            assert page_ledger_violations(sched.allocator, sched.cache, []) == []
        got, share = [], []
        for i in range(0, len(second), 2):
            for r in engine.generate(second[i : i + 2], sp):
                got.append(r.output_ids)
                share.append(r.cached_tokens / len(r.prompt_ids))
            assert page_ledger_violations(sched.allocator, sched.cache, []) == []
        assert got == expected, name
        assert_pool_clean(engine)
        cached[name] = share
    assert min(cached["tier"]) >= 0.7, cached["tier"]
    assert max(cached["no tier"]) < 0.3, cached["no tier"]


# ---- the Redis index: tiers published and matched -----------------------------------------------------------


def test_index_records_the_tier_and_the_router_weighs_it(redis_server) -> None:
    model = f"tier-{uuid.uuid4().hex[:8]}"
    pub = PrefixIndexPublisher(redis_server, model, "pod-a", flush_interval_s=0.01, resync_host=lambda: [])
    other = PrefixIndexPublisher(redis_server, model, "pod-b", flush_interval_s=0.01)
    reader = PrefixIndexReader(redis_server, model)
    loop = asyncio.new_event_loop()
    try:
        pub.start()
        other.start()
        hashes = list(range(1, 9))
        pub.stored(hashes[:3])
        pub.stored(hashes[3:6], "host")
        other.stored(hashes[:2])
        assert pub.wait_idle() and other.wait_idle()
        tiers = loop.run_until_complete(reader.match_tiers(hashes, ["pod-a", "pod-b"]))
        assert tiers == {"pod-a": (3, 3), "pod-b": (2, 0)}
        assert loop.run_until_complete(reader.match(hashes, ["pod-a"])) == {"pod-a": 6}
        # A device hit counts in full, a host hit for less, a miss for nothing.
        assert saved_blocks(3, 0) > saved_blocks(0, 3) > saved_blocks(0, 0)
        pub.stored(hashes[3:4])  # loaded back: on the device again, off the host
        pub.removed(hashes[4:6])
        assert pub.wait_idle()
        tiers = loop.run_until_complete(reader.match_tiers(hashes, ["pod-a"]))
        assert tiers == {"pod-a": (4, 0)}
        r = redis.Redis.from_url(redis_server)
        assert not r.sismember(IndexKeys(model).host_block(hashes[3]), "pod-a")
        r.close()
        pub.stop(deregister=True)  # clears both tiers' entries
        assert loop.run_until_complete(reader.match_tiers(hashes, ["pod-a"])) == {"pod-a": (0, 0)}
    finally:
        other.stop(deregister=True)
        loop.run_until_complete(reader.aclose())
        loop.close()


# ---- a worker over real HTTP --------------------------------------------------------------------------------


def test_worker_serves_prefixes_from_its_host_tier(redis_server, smol_tokenizer, smol_runner) -> None:
    env = {"KVFERRY_NUM_PAGES": "48", "KVFERRY_HOST_KV_GB": "0.25", "KVFERRY_MAX_PREFILL_TOKENS": "256"}
    d = start_worker("decode", redis_server, env=env)
    try:
        wait_ready(d)
        docs = [
            smol_tokenizer.encode(f"Document {i}: " + f"notes on topic {i}, chapter by chapter and line by line. " * 16)
            for i in range(6)
        ]
        assert all(len(x) >= 160 for x in docs)  # 6 x >= 10 pages against a pool of 48 pages
        questions = [smol_tokenizer.encode(f" Question {k}: what is it about?") for k in range(2)]
        for doc in docs:
            generate(d, doc + questions[0], None, max_tokens=4)
        r = redis.Redis.from_url(redis_server)
        wait_until(  # the publisher flushes every 50 ms
            lambda: any(r.sismember(k, d.pod) for k in r.scan_iter(match="kvf:*:hblk:*", count=1000)),
            5,
            "the worker to publish host-tier blocks",
            interval=0.1,
        )
        r.close()
        cold = fresh_engine(smol_runner, prefix_cache=False)
        for doc in docs:
            prompt = doc + questions[1]
            tokens, events = generate(d, prompt, None, max_tokens=4)
            assert events[0]["cached_tokens"] >= 0.7 * len(prompt)
            ref = cold.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].output_ids
            assert tokens == ref
        wait_ledger_checked(d)
        metrics = httpx.get(f"{d.url}/metrics", timeout=5).text
        line = next(ln for ln in metrics.splitlines() if ln.startswith("kvferry_kv_integrity_violations_total"))
        assert float(line.split()[-1]) == 0
        load = d.load()
        assert load["host_pages_total"] > 0 and load["host_pages_cached"] > 0
        assert load["host_pages_locked"] == load["host_pages_total"]  # the CPU's tier needs no locking
        assert load["host_pages_saved"] > 0 and load["host_pages_loaded"] > 0
        moved = {
            ln.split('"')[1]: float(ln.split()[-1])
            for ln in metrics.splitlines()
            if ln.startswith("kvferry_host_kv_pages_moved_total{")
        }
        assert moved["saved"] > 0 and moved["loaded"] > 0
    finally:
        d.stop()


def wait_ledger_checked(w: WorkerProc) -> None:
    """The worker is idle with every page back and its engine has run its idle ledger check: the check runs on
    the first idle turn, before that turn's report, so a load report from a later turn than the first one
    showing every page back comes after it (and after any violation it counted)."""
    wait_pages_back(w)
    idle_turn = w.load()["loop_turns"]
    wait_until(lambda: (ld := w.load())["loop_turns"] > idle_turn and pages_back(ld), 10, "the idle ledger check")
