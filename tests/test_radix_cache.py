from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.kv.allocator import PageAllocator
from common.kv.radix import RadixCache, RadixNode

PS = 4


def make(num_pages: int = 64, page_size: int = PS) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return RadixCache(page_size, alloc), alloc


def fake_hashes(tokens: list[int], page_size: int) -> list[int]:
    # Stand-in for chained block hashing: a page's hash depends on the whole prefix up to it, so equal
    # prefixes hash equal and a hash identifies one position in the tree.
    return [hash(tuple(tokens[: (i + 1) * page_size])) for i in range(len(tokens) // page_size)]


def alloc_and_insert(cache: RadixCache, alloc: PageAllocator, tokens: list[int]) -> tuple[torch.Tensor, int, RadixNode]:
    """Inserts `tokens` with fresh pages, frees the duplicates, returns (pages passed, cached, node)."""
    n = len(tokens) // cache.page_size
    pages = alloc.alloc(n)
    assert pages is not None
    already, node = cache.insert(tokens, pages, fake_hashes(tokens, cache.page_size))
    alloc.free(pages[: already // cache.page_size])
    return pages, already, node


def tree_nodes(cache: RadixCache) -> list[RadixNode]:
    out: list[RadixNode] = []
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def path_pages(cache: RadixCache, node: RadixNode) -> torch.Tensor:
    chunks = []
    while node is not cache.root:
        chunks.append(node.pages)
        assert node.parent is not None
        node = node.parent
    return torch.cat(chunks[::-1]) if chunks else torch.empty(0, dtype=torch.int64)


def path_len(cache: RadixCache, node: RadixNode) -> int:
    total = 0
    while node is not cache.root:
        total += len(node.key)
        assert node.parent is not None
        node = node.parent
    return total


# ---- unit tests ---------------------------------------------------------------------------------


def test_match_on_empty_tree_returns_root() -> None:
    cache, _ = make()
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.node is cache.root
    assert m.matched_len == 0
    assert m.pages.dtype == torch.int64 and m.pages.numel() == 0
    assert cache.cached_pages == 0


def test_insert_then_full_match() -> None:
    cache, alloc = make()
    tokens = list(range(12))
    pages, already, node = alloc_and_insert(cache, alloc, tokens)
    assert already == 0
    m = cache.match_prefix(tokens)
    assert m.matched_len == 12
    assert m.node is node
    assert torch.equal(m.pages, pages)
    assert cache.evictable_pages == 3 and cache.protected_pages == 0


def test_match_ignores_unaligned_tail_and_respects_max_len() -> None:
    cache, alloc = make()
    tokens = list(range(12))
    pages, _, _ = alloc_and_insert(cache, alloc, tokens)
    # 11 tokens: only two whole pages can match.
    m = cache.match_prefix(tokens, max_len=11)
    assert m.matched_len == 8
    assert torch.equal(m.pages, pages[:2])
    assert cache.match_prefix(tokens, max_len=3).matched_len == 0
    # A longer query matches what is there, and a tensor query behaves like a list.
    m = cache.match_prefix(torch.tensor(tokens + [99] * 7))
    assert m.matched_len == 12


def test_partial_match_splits_node_at_page_boundary() -> None:
    cache, alloc = make()
    tokens = list(range(16))
    pages, _, leaf = alloc_and_insert(cache, alloc, tokens)
    query = tokens[:9] + [100, 101, 102, 103]  # diverges inside page 2
    m = cache.match_prefix(query)
    assert m.matched_len == 8
    assert torch.equal(m.pages, pages[:2])
    # The split node ends exactly at the match and is the parent of the original node object.
    assert path_len(cache, m.node) == 8
    assert m.node.parent is cache.root
    assert leaf.parent is m.node
    assert leaf.key == tuple(tokens[8:])
    assert torch.equal(leaf.pages, pages[2:])
    assert m.node.block_hashes == fake_hashes(tokens, PS)[:2]
    assert leaf.block_hashes == fake_hashes(tokens, PS)[2:]
    assert cache.cached_pages == 4
    # Full match still reaches the original node.
    assert cache.match_prefix(tokens).node is leaf


def test_split_of_locked_node_keeps_counters() -> None:
    cache, alloc = make()
    tokens = list(range(16))
    _, _, leaf = alloc_and_insert(cache, alloc, tokens)
    cache.lock(leaf)
    assert cache.protected_pages == 4
    m = cache.match_prefix(tokens[:8])
    assert m.node.ref_count == 1 and leaf.ref_count == 1
    assert cache.protected_pages == 4 and cache.evictable_pages == 0
    cache.unlock(leaf)
    assert m.node.ref_count == 0
    assert cache.protected_pages == 0 and cache.evictable_pages == 4


def test_insert_returns_already_cached_len() -> None:
    cache, alloc = make()
    a = [1] * 8 + [2] * 8
    b = [1] * 8 + [3] * 8 + [4, 4]  # shares two pages, plus an unaligned tail
    _, already, _ = alloc_and_insert(cache, alloc, a)
    assert already == 0
    pages_b = alloc.alloc(4)
    assert pages_b is not None
    already, node = cache.insert(b, pages_b)
    assert already == 8
    assert path_len(cache, node) == 16  # last_node ends at the aligned length
    # The cache took pages_b[2:4]; pages_b[:2] stay with the caller and must not be in the tree.
    tree_pages = set(torch.cat([n.pages for n in tree_nodes(cache)]).tolist())
    assert set(pages_b[2:].tolist()) <= tree_pages
    assert not set(pages_b[:2].tolist()) & tree_pages
    assert cache.cached_pages == 6
    # Inserting the same thing again caches nothing new.
    again = alloc.alloc(4)
    assert again is not None
    already, node2 = cache.insert(b, again)
    assert already == 16 and node2 is node
    assert cache.cached_pages == 6


def test_insert_uses_only_pages_provided() -> None:
    cache, alloc = make()
    pages = alloc.alloc(2)
    assert pages is not None
    already, node = cache.insert(list(range(20)), pages)
    assert already == 0 and path_len(cache, node) == 8
    assert cache.insert([], pages[:0]) == (0, cache.root)


def test_lock_prevents_eviction() -> None:
    cache, alloc = make()
    _, _, a = alloc_and_insert(cache, alloc, [1] * 8)
    _, _, b = alloc_and_insert(cache, alloc, [2] * 8)
    cache.lock(a)
    assert cache.protected_pages == 2 and cache.evictable_pages == 2
    assert cache.evict(100) == 2
    assert b.parent is None and a.parent is cache.root
    assert cache.evict(100) == 0
    assert cache.cached_pages == 2
    cache.unlock(a)
    assert cache.evict(1) == 2
    assert cache.cached_pages == 0 and alloc.num_free == alloc.num_pages


def test_lock_protects_ancestors_and_unlock_underflow_raises() -> None:
    cache, alloc = make()
    _, _, parent = alloc_and_insert(cache, alloc, [1] * 8)
    _, _, child = alloc_and_insert(cache, alloc, [1] * 8 + [2] * 4)
    assert child.parent is parent
    cache.lock(child)
    assert parent.ref_count == 1 and cache.protected_pages == 3
    assert cache.evict(10) == 0
    cache.unlock(child)
    with pytest.raises(RuntimeError):
        cache.unlock(child)
    assert parent.ref_count == 0 and cache.evictable_pages == 3
    # Root is never locked.
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.root.ref_count == 0


def test_evict_lru_order() -> None:
    cache, alloc = make()
    _, _, a = alloc_and_insert(cache, alloc, [1] * 4)
    _, _, b = alloc_and_insert(cache, alloc, [2] * 4)
    _, _, c = alloc_and_insert(cache, alloc, [3] * 4)
    cache.match_prefix([1] * 4)  # a becomes most recently used
    assert cache.evict(1) == 1
    assert b.parent is None and a.parent is not None and c.parent is not None
    assert cache.evict(1) == 1
    assert c.parent is None and a.parent is not None


def test_evict_repushes_parent_that_becomes_leaf() -> None:
    cache, alloc = make()
    _, _, parent = alloc_and_insert(cache, alloc, [1] * 8)
    _, _, child = alloc_and_insert(cache, alloc, [1] * 8 + [2] * 4)
    _, _, other = alloc_and_insert(cache, alloc, [5] * 4)
    cache.match_prefix([5] * 4)  # `other` is the newest; parent/child are older
    assert cache.evict(3) == 3
    assert child.parent is None and parent.parent is None and other.parent is cache.root
    assert alloc.num_free == alloc.num_pages - 1


def test_drain_evicted_hashes_after_split() -> None:
    cache, alloc = make()
    tokens = list(range(16))
    _, _, leaf = alloc_and_insert(cache, alloc, tokens)
    hashes = fake_hashes(tokens, PS)
    m = cache.match_prefix(tokens[:8] + [77] * 4)  # splits after two pages
    cache.lock(m.node)
    assert cache.evict(100) == 2  # only the lower half is evictable
    assert leaf.parent is None
    assert cache.drain_evicted_hashes() == hashes[2:]
    assert cache.drain_evicted_hashes() == []
    assert sorted(cache.all_block_hashes()) == sorted(hashes[:2])
    cache.unlock(m.node)
    cache.evict(1)
    assert cache.drain_evicted_hashes() == hashes[:2]
    assert cache.all_block_hashes() == []


def test_reset() -> None:
    cache, alloc = make()
    _, _, a = alloc_and_insert(cache, alloc, list(range(8)))
    alloc_and_insert(cache, alloc, list(range(4)) + [9] * 8)  # shares the first page
    cache.lock(a)
    with pytest.raises(RuntimeError):
        cache.reset()
    assert cache.cached_pages == 4  # nothing freed by the failed reset
    cache.unlock(a)
    cache.reset()
    assert cache.cached_pages == 0 and cache.evictable_pages == 0
    assert alloc.num_free == alloc.num_pages
    assert cache.match_prefix(list(range(8))).matched_len == 0
    assert len(cache.drain_evicted_hashes()) == 4
    with pytest.raises(RuntimeError):
        cache.lock(a)  # stale node from before the reset


def test_match_4k_prompt_is_fast() -> None:
    page_size = 16
    cache, alloc = make(num_pages=4096, page_size=page_size)
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, 32000, (4096,), generator=gen).tolist()
    # A few branches off the prompt so the walk crosses several edges.
    for cut in (512, 1024, 2048, 3072, 4096):
        alloc_and_insert(cache, alloc, base[:cut] + [1] * 64)
    query = torch.tensor(base)
    cache.match_prefix(query)
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        m = cache.match_prefix(query)
        times.append(time.perf_counter() - t0)
    assert m.matched_len == 4096
    times.sort()
    # Generous bound for slow CI machines; typical is a few tens of microseconds.
    assert times[len(times) // 2] < 2e-3


# ---- stateful property test ---------------------------------------------------------------------

SM_PAGE_SIZE = 2
SM_NUM_PAGES = 24
# Shared "system prompts": cutting them at random points and appending random tails makes requests
# share prefixes and diverge inside cached edges, which is what exercises splits of locked nodes.
SM_BASES = ([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 2, 2, 1, 1, 0, 0, 2, 1], [1, 1, 1, 1, 2, 2, 2, 2])
sm_tokens = st.one_of(
    st.lists(st.integers(0, 2), min_size=1, max_size=14),
    st.builds(
        lambda base, cut, tail: base[:cut] + tail,
        st.sampled_from(SM_BASES),
        st.integers(0, 12),
        st.lists(st.integers(0, 2), max_size=4),
    ).filter(bool),
)


@dataclass
class LiveReq:
    tokens: list[int]
    node: RadixNode  # locked match node
    prefix_pages: torch.Tensor  # tree pages reused (protected while live)
    owned: torch.Tensor  # pages allocated for the rest, owned by the request


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(SM_NUM_PAGES)
        self.cache = RadixCache(SM_PAGE_SIZE, self.alloc)
        self.live: dict[int, LiveReq] = {}
        self.next_id = 0
        # What a worker would have published to Redis: added on insert, removed via drained hashes.
        self.published: set[int] = set()

    @rule(
        tokens=sm_tokens,
        use_max_len=st.booleans(),
    )
    def new_request(self, tokens: list[int], use_max_len: bool) -> None:
        ps = SM_PAGE_SIZE
        # Like a scheduler, keep at least one token to compute when asked.
        m = self.cache.match_prefix(tokens, max_len=len(tokens) - 1 if use_max_len else None)
        assert m.matched_len % ps == 0 and m.matched_len <= len(tokens)
        assert path_len(self.cache, m.node) == m.matched_len
        assert torch.equal(m.pages, path_pages(self.cache, m.node))
        self.cache.lock(m.node)
        need = -(-len(tokens) // ps) - m.matched_len // ps
        if self.alloc.num_free < need:
            self.cache.evict(need - self.alloc.num_free)
        owned = self.alloc.alloc(need)
        if owned is None:
            # Not admissible right now: give the lock back like a scheduler would.
            assert self.cache.evictable_pages + self.alloc.num_free < need
            self.cache.unlock(m.node)
            return
        self.live[self.next_id] = LiveReq(tokens, m.node, m.pages.clone(), owned)
        self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(min_value=0))
    def finish_request(self, pick: int) -> None:
        ps = SM_PAGE_SIZE
        rid = sorted(self.live)[pick % len(self.live)]
        req = self.live.pop(rid)
        all_pages = torch.cat([req.prefix_pages, req.owned])
        n = len(req.tokens) // ps
        hashes = fake_hashes(req.tokens, ps)
        already, last = self.cache.insert(req.tokens, all_pages[:n], hashes)
        assert already % ps == 0
        assert already >= req.prefix_pages.numel() * ps  # the locked prefix cannot have gone
        assert path_len(self.cache, last) == n * ps
        # Per insert's contract: of the already-cached range, free what differs from the tree.
        k = already // ps
        tree = path_pages(self.cache, last)[:k]
        dup = all_pages[:k][all_pages[:k] != tree]
        assert set(dup.tolist()) <= set(req.owned.tolist())
        self.alloc.free(dup)
        self.alloc.free(all_pages[n:])  # unaligned tail page, never cached
        self.published.update(hashes[k:n])
        self.cache.unlock(req.node)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(min_value=0))
    def abort_request(self, pick: int) -> None:
        rid = sorted(self.live)[pick % len(self.live)]
        req = self.live.pop(rid)
        self.alloc.free(req.owned)
        self.cache.unlock(req.node)

    @rule(amount=st.integers(0, SM_NUM_PAGES + 2))
    def evict(self, amount: int) -> None:
        before_free = self.alloc.num_free
        before_evictable = self.cache.evictable_pages
        freed = self.cache.evict(amount)
        assert self.alloc.num_free == before_free + freed
        assert self.cache.evictable_pages == before_evictable - freed
        assert freed >= amount or self.cache.evictable_pages == 0

    @invariant()
    def pages_are_conserved(self) -> None:
        nodes = tree_nodes(self.cache)
        tree = [p for n in nodes for p in n.pages.tolist()]
        held = [p for r in self.live.values() for p in r.owned.tolist()]
        free = torch.nonzero(self.alloc.is_free(torch.arange(SM_NUM_PAGES))).flatten().tolist()
        everything = tree + held + free
        assert len(everything) == len(set(everything)) == SM_NUM_PAGES
        assert self.alloc.num_free + len(held) + self.cache.cached_pages == SM_NUM_PAGES

    @invariant()
    def locked_pages_stay_in_tree(self) -> None:
        for req in self.live.values():
            node = req.node
            assert node is self.cache.root or node.parent is not None
            assert torch.equal(path_pages(self.cache, node), req.prefix_pages)
            assert not bool(self.alloc.is_free(req.prefix_pages).any())

    @invariant()
    def counters_and_structure(self) -> None:
        ps = SM_PAGE_SIZE
        cache = self.cache
        expected_refs: dict[int, int] = {}
        for req in self.live.values():
            node = req.node
            while node is not cache.root:
                expected_refs[id(node)] = expected_refs.get(id(node), 0) + 1
                assert node.parent is not None
                node = node.parent
        protected = evictable = 0
        for node in tree_nodes(cache):
            assert node.ref_count == expected_refs.get(id(node), 0)
            assert len(node.key) > 0 and len(node.key) == node.pages.numel() * ps
            assert len(node.block_hashes) == node.pages.numel()
            assert node.parent is not None and node.parent.children[node.key[:ps]] is node
            if node.ref_count > 0:
                protected += node.pages.numel()
            else:
                evictable += node.pages.numel()
        assert cache.protected_pages == protected
        assert cache.evictable_pages == evictable
        assert cache.cached_pages == protected + evictable
        assert cache.root.ref_count == 0

    @invariant()
    def evicted_hashes_track_published(self) -> None:
        drained = self.cache.drain_evicted_hashes()
        assert len(drained) == len(set(drained))
        assert set(drained) <= self.published
        self.published -= set(drained)
        assert sorted(self.cache.all_block_hashes()) == sorted(self.published)

    def teardown(self) -> None:
        for req in self.live.values():
            self.alloc.free(req.owned)
            self.cache.unlock(req.node)
        self.cache.reset()
        assert self.alloc.num_free == SM_NUM_PAGES
        assert self.cache.cached_pages == 0


RadixMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestRadixMachine = RadixMachine.TestCase
