"""One file because match, insert, evict and the moves between tiers all keep the same tree's invariants.

Page-aligned radix (prefix) cache over token ids, in two tiers with a `HostTier` (docs/architecture.md,
"Host KV tier"). Only whole pages are cached (the unit allocated, transferred and hashed). Pages in the tree
belong to it until `evict` or `reset`; locked nodes' pages never go back. Device nodes form the top of the
tree, so a match is a device prefix then a host suffix and only device nodes are locked.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.kv.allocator import PageAllocator
from common.kv.host_tier import HostTier

TokenKey = tuple[int, ...]
# Where a block is, for the prefix index: "device", "host", or None (no longer cached).
IndexEvent = tuple[str | None, list[int]]


def _empty_pages() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree plus the node it leads to (`eq=False`: identity hashing, so nodes sit in sets)."""

    key: TokenKey = ()
    pages: torch.Tensor = field(default_factory=_empty_pages)
    block_hashes: list[int] = field(default_factory=list)
    # Keyed by the child's first page: siblings never share one.
    children: dict[TokenKey, RadixNode] = field(default_factory=dict, repr=False)
    parent: RadixNode | None = field(default=None, repr=False)
    ref_count: int = 0
    last_access: int = 0
    on_host: bool = False  # `pages` are host-tier page ids (never locked; every descendant is on the host too)
    device_children: int = 0  # children on the device: a device node without any is a device leaf

    @property
    def num_pages(self) -> int:
        return int(self.pages.numel())


@dataclass
class MatchResult:
    node: RadixNode  # deepest fully matched device node, ending exactly at matched_len (root when none)
    pages: torch.Tensor  # int64 device page ids of the matched tokens, in order
    matched_len: int  # tokens matched on the device; always a multiple of page_size
    # The match's continuation in the host tier, top down (`RadixCache.load_back` brings it onto the device).
    host_nodes: list[RadixNode] = field(default_factory=list)
    host_len: int = 0


def _as_tokens(token_ids: Sequence[int] | torch.Tensor) -> TokenKey:
    # Tuples compare and slice in C; tolist() avoids a 0-d tensor per element.
    if isinstance(token_ids, tuple):
        return token_ids
    tolist = getattr(token_ids, "tolist", None)
    if tolist is not None:
        return tuple(tolist())
    return tuple(token_ids)


class RadixCache:
    def __init__(self, page_size: int, allocator: PageAllocator, host: HostTier | None = None) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self.allocator = allocator
        self.host = host
        self.root = RadixNode()
        self._evictable = 0
        self._protected = 0
        # Non-root device nodes without device children: the only device eviction candidates.
        self._leaves: set[RadixNode] = set()
        self._host_leaves: set[RadixNode] = set()  # host nodes without children: what the host tier drops
        self._host_cached = 0
        self._host_heap: list[tuple[int, int, RadixNode]] | None = None  # during one `evict` call
        self._pinned: set[RadixNode] = set()  # host nodes being loaded back: never dropped meanwhile
        self._index_events: list[IndexEvent] = []
        self._clock = 0
        self._seq = itertools.count()

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    @property
    def cached_pages(self) -> int:
        return self._evictable + self._protected

    @property
    def host_cached_pages(self) -> int:
        return self._host_cached

    def match_prefix(self, token_ids: Sequence[int], max_len: int | None = None) -> MatchResult:
        """Longest page-aligned prefix of `token_ids[:max_len]`, its host part in `host_nodes`; refreshes LRU
        stamps. Does not lock: the caller locks `node` if it reuses the pages."""
        tokens = _as_tokens(token_ids)
        if max_len is not None:
            tokens = tokens[: max(max_len, 0)]
        limit = len(tokens) // self.page_size * self.page_size
        tick = self._tick()

        node = self.root
        pos = 0
        chunks: list[torch.Tensor] = []
        device_node, device_len = self.root, 0
        host_nodes: list[RadixNode] = []
        while pos < limit:
            child = node.children.get(tokens[pos : pos + self.page_size])
            if child is None:
                break
            matched = self._matched_tokens(child.key, tokens, pos, limit)
            if matched < len(child.key):
                # The returned node must end exactly at matched_len: a lock covers exactly the pages reused.
                child = self._split(child, matched // self.page_size)
            child.last_access = tick
            node = child
            pos += matched
            if child.on_host:
                host_nodes.append(child)
            else:
                chunks.append(child.pages)
                device_node, device_len = child, pos

        pages = torch.cat(chunks) if chunks else _empty_pages()
        return MatchResult(device_node, pages, device_len, host_nodes, pos - device_len)

    def load_back(self, match: MatchResult) -> MatchResult:
        """Copies `match`'s host part into fresh device pages and returns the match as it now stands on the
        device (its device part alone without pages to spare). Locks nothing."""
        if not match.host_nodes:
            return match
        assert self.host is not None
        need = sum(n.num_pages for n in match.host_nodes)
        self.lock(match.node)
        self._pinned = set(match.host_nodes)
        try:
            if need > self.allocator.num_free:
                self.evict(need - self.allocator.num_free)
            dev = self.allocator.alloc(need)
        finally:
            self._pinned = set()
            self.unlock(match.node)
        if dev is None:
            return MatchResult(match.node, match.pages, match.matched_len)
        host_pages = torch.cat([n.pages for n in match.host_nodes])
        self.host.load(host_pages, dev)
        self.host.allocator.free(host_pages)
        off = 0
        for node in match.host_nodes:  # top down: each node's parent is on the device when it moves up
            k = node.num_pages
            self._to_device(node, dev[off : off + k].clone())
            off += k
        return MatchResult(match.host_nodes[-1], torch.cat([match.pages, dev]), match.matched_len + match.host_len)

    def take_host_pages(self, n: int) -> torch.Tensor | None:
        """`n` host-tier pages for a live request's KV (a preempted request parks there), dropping cached host
        prefixes, least recently used first, to make room: a parked request's KV is certain to be read again,
        a cached prefix only may be. None without a tier or when it cannot hold `n`. The caller frees them to
        `host.allocator`."""
        if self.host is None or n <= 0:
            return None
        try:
            room = self._make_host_room(n, older_than=self._clock)
        finally:
            self._host_heap = None
        return self.host.allocator.alloc(n) if room else None

    def lock(self, node: RadixNode) -> None:
        self._check_attached(node)
        if node.on_host:
            raise RuntimeError("RadixCache.lock: node is in the host tier (load it back first)")
        while node is not self.root:
            if node.ref_count == 0:
                self._evictable -= node.num_pages
                self._protected += node.num_pages
            node.ref_count += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        if node is self.root:
            return
        # Ancestors hold at least the node's count: checking it alone means nothing is half-decremented on raise.
        if node.ref_count <= 0:
            raise RuntimeError("RadixCache.unlock: ref_count underflow")
        self._check_attached(node)
        while node is not self.root:
            node.ref_count -= 1
            if node.ref_count == 0:
                self._protected -= node.num_pages
                self._evictable += node.num_pages
            assert node.parent is not None
            node = node.parent

    def insert(
        self,
        token_ids: Sequence[int],
        pages: torch.Tensor,
        block_hashes: Sequence[int] | None = None,
    ) -> tuple[int, RadixNode]:
        """Caches the page-aligned prefix of `token_ids` backed by `pages`; returns `(already_cached_len,
        last_node)`. The cache owns `pages[already_cached_len // page_size : n]` only, except that a host node on
        the path adopts the caller's device pages for its range (compare with `match_prefix`'s pages)."""
        tokens = _as_tokens(token_ids)
        ps = self.page_size
        n = min(len(tokens) // ps, int(pages.numel()))
        if block_hashes is not None and len(block_hashes) < n:
            raise ValueError("block_hashes must be parallel to pages")
        limit = n * ps
        tick = self._tick()

        node = self.root
        pos = 0
        while pos < limit:
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                first, last = pos // ps, n
                leaf = RadixNode(
                    key=tokens[pos:limit],
                    # Own copy: the caller's tensor may be a view into a page table it keeps mutating.
                    pages=pages[first:last].to(device="cpu", dtype=torch.int64).clone(),
                    block_hashes=[int(h) for h in block_hashes[first:last]] if block_hashes is not None else [],
                    parent=node,
                    last_access=tick,
                )
                node.children[leaf.key[:ps]] = leaf
                node.device_children += 1
                self._leaves.discard(node)
                self._leaves.add(leaf)
                self._evictable += leaf.num_pages
                return pos, leaf
            matched = self._matched_tokens(child.key, tokens, pos, limit)
            if matched < len(child.key):
                child = self._split(child, matched // ps)
            child.last_access = tick
            if child.on_host:
                first = pos // ps
                self.host.allocator.free(child.pages)  # type: ignore[union-attr]
                self._to_device(
                    child, pages[first : first + child.num_pages].to(device="cpu", dtype=torch.int64).clone()
                )
            node = child
            pos += matched
        return pos, node

    def evict(self, num_pages: int) -> int:
        """Frees at least `num_pages` device pages when that many are evictable, LRU device leaves first (moved to
        the host tier when it has room); returns how many it freed."""
        if num_pages <= 0:
            return 0
        heap = [(leaf.last_access, next(self._seq), leaf) for leaf in self._leaves if leaf.ref_count == 0]
        heapq.heapify(heap)
        freed = 0
        to_free: list[torch.Tensor] = []
        self._host_heap = None
        try:
            while freed < num_pages and heap:
                _, _, leaf = heapq.heappop(heap)
                parent = leaf.parent
                assert parent is not None
                to_free.append(leaf.pages)
                freed += leaf.num_pages
                if not self._demote(leaf):
                    self._drop_device_leaf(leaf)
                if parent is not self.root and parent.device_children == 0 and parent.ref_count == 0:
                    heapq.heappush(heap, (parent.last_access, next(self._seq), parent))
        finally:
            self._host_heap = None
        if to_free:
            # One allocator call: its double-free check is a tensor op, cheaper batched.
            self.allocator.free(torch.cat(to_free))
        return freed

    def drain_index_events(self) -> list[IndexEvent]:
        """Changes of tier since the last call, in order: (tier, hashes), tier None for blocks no longer cached.
        Inserted blocks appear only as their inserter notes them (`note_stored`)."""
        out, self._index_events = self._index_events, []
        return out

    def note_stored(self, hashes: list[int]) -> None:
        self._index_events.append(("device", hashes))

    def drain_evicted_hashes(self) -> list[int]:
        """Hashes of blocks no longer cached since the last drain (for a cache without a host tier)."""
        return [h for tier, hashes in self.drain_index_events() if tier is None for h in hashes]

    def all_block_hashes(self, tier: str | None = None) -> list[int]:
        out: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if tier is None or node.on_host == (tier == "host"):
                out.extend(node.block_hashes)
            stack.extend(node.children.values())
        return out

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError("RadixCache.reset: nodes are still locked")
        to_free: list[torch.Tensor] = []
        host_free: list[torch.Tensor] = []
        gone: list[int] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            (host_free if node.on_host else to_free).append(node.pages)
            gone.extend(node.block_hashes)
            stack.extend(node.children.values())
            # Detached: a stale reference fails loudly in lock() instead of resurrecting freed pages.
            node.parent = None
            node.children = {}
        self.root.children = {}
        self.root.device_children = 0
        self._leaves.clear()
        self._host_leaves.clear()
        self._evictable = 0
        self._host_cached = 0
        if gone:
            self._index_events.append((None, gone))
        if to_free:
            self.allocator.free(torch.cat(to_free))
        if host_free:
            assert self.host is not None
            self.host.allocator.free(torch.cat(host_free))

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _matched_tokens(self, key: TokenKey, tokens: TokenKey, pos: int, limit: int) -> int:
        """Tokens of `key` matching `tokens[pos:limit]`, rounded down to whole pages (at least one)."""
        ps = self.page_size
        span = min(len(key), limit - pos)
        if tokens[pos : pos + span] == key[:span]:
            return span
        off = ps
        while off < span and tokens[pos + off : pos + off + ps] == key[off : off + ps]:
            off += ps
        return off

    def _split(self, node: RadixNode, at_pages: int) -> RadixNode:
        """Splits `node` after `at_pages` pages and returns the new upper half; `node` keeps the lower half, so
        holders of it still refer to the same token range."""
        assert 0 < at_pages < node.num_pages
        ps = self.page_size
        cut = at_pages * ps
        parent = node.parent
        assert parent is not None
        upper = RadixNode(
            key=node.key[:cut],
            pages=node.pages[:at_pages].clone(),
            block_hashes=node.block_hashes[:at_pages],
            parent=parent,
            # Both halves keep the lock state: the evictable/protected counters need no change.
            ref_count=node.ref_count,
            last_access=node.last_access,
            on_host=node.on_host,
            device_children=0 if node.on_host else 1,
        )
        node.key = node.key[cut:]
        node.pages = node.pages[at_pages:].clone()
        node.block_hashes = node.block_hashes[at_pages:]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        parent.children[upper.key[:ps]] = upper
        return upper

    def _demote(self, leaf: RadixNode) -> bool:
        """Moves an unlocked device leaf to the host tier (the caller frees its device pages); False without room."""
        host = self.host
        n = leaf.num_pages
        if host is None or not self._make_host_room(n, leaf.last_access):
            return False
        host_pages = host.allocator.alloc(n)
        assert host_pages is not None
        host.save(leaf.pages, host_pages)
        parent = leaf.parent
        assert parent is not None
        leaf.pages = host_pages
        leaf.on_host = True
        parent.device_children -= 1
        self._leaves.discard(leaf)
        if parent is not self.root and parent.device_children == 0:
            self._leaves.add(parent)
        self._evictable -= n
        self._host_cached += n
        if not leaf.children:
            self._add_host_leaf(leaf)
        self._index_events.append(("host", list(leaf.block_hashes)))
        return True

    def _to_device(self, node: RadixNode, device_pages: torch.Tensor) -> None:
        """A host node whose KV is now in `device_pages` joins the device tier (its parent must be there)."""
        parent = node.parent
        assert parent is not None and not parent.on_host and node.on_host and node.ref_count == 0
        n = node.num_pages
        node.pages = device_pages
        node.on_host = False
        parent.device_children += 1
        self._leaves.discard(parent)
        self._host_leaves.discard(node)
        if node.device_children == 0:
            self._leaves.add(node)
        self._host_cached -= n
        self._evictable += n
        self._index_events.append(("device", list(node.block_hashes)))

    def _make_host_room(self, n: int, older_than: int) -> bool:
        """Drops LRU host leaves, none used after `older_than`, until `n` host pages are free."""
        host = self.host
        assert host is not None
        if n > host.num_pages or not host.ready:  # not yet page-locked: as if there were no tier
            return False
        if self._host_heap is None:
            self._host_heap = [(x.last_access, next(self._seq), x) for x in self._host_leaves]
            heapq.heapify(self._host_heap)
        heap = self._host_heap
        while host.allocator.num_free < n and heap:
            stamp, _, node = heap[0]
            if node.parent is None or not node.on_host or node.children or node in self._pinned:
                heapq.heappop(heap)  # dropped, loaded back or pinned since it was pushed
                continue
            if stamp > older_than:
                break  # every host entry left was used more recently than the one asking for room
            heapq.heappop(heap)
            parent = node.parent
            self._drop_host_leaf(node)
            if parent.on_host and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(self._seq), parent))
        return host.allocator.num_free >= n

    def _add_host_leaf(self, node: RadixNode) -> None:
        self._host_leaves.add(node)
        if self._host_heap is not None:
            heapq.heappush(self._host_heap, (node.last_access, next(self._seq), node))

    def _drop_host_leaf(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None and node.on_host and not node.children and self.host is not None
        del parent.children[node.key[: self.page_size]]
        node.parent = None
        self._host_leaves.discard(node)
        if parent.on_host and not parent.children:
            self._add_host_leaf(parent)
        self.host.allocator.free(node.pages)
        self._host_cached -= node.num_pages
        self._index_events.append((None, list(node.block_hashes)))

    def _drop_device_leaf(self, leaf: RadixNode) -> None:
        """Detaches an unlocked device leaf (the caller frees its pages) and drops the host subtree below it."""
        parent = leaf.parent
        assert parent is not None and not leaf.on_host and leaf.device_children == 0 and leaf.ref_count == 0
        gone = list(leaf.block_hashes)
        host_free: list[torch.Tensor] = []
        stack = list(leaf.children.values())
        while stack:
            node = stack.pop()
            host_free.append(node.pages)
            self._host_cached -= node.num_pages
            self._host_leaves.discard(node)
            gone.extend(node.block_hashes)
            stack.extend(node.children.values())
            node.parent = None
            node.children = {}
        if host_free:
            assert self.host is not None
            self.host.allocator.free(torch.cat(host_free))
        leaf.children = {}
        del parent.children[leaf.key[: self.page_size]]
        leaf.parent = None
        parent.device_children -= 1
        self._leaves.discard(leaf)
        if parent is not self.root and parent.device_children == 0:
            self._leaves.add(parent)
        self._evictable -= leaf.num_pages
        self._index_events.append((None, gone))

    def _check_attached(self, node: RadixNode) -> None:
        if node is not self.root and node.parent is None:
            raise RuntimeError("RadixCache: node was evicted or reset")
