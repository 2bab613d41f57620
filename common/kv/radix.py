"""Page-aligned radix (prefix) cache over token ids.

Every edge of the tree is labelled by a run of whole pages of token ids and carries the KV page ids
holding those tokens, so a prompt that shares a prefix with an earlier one can reuse its KV pages
instead of recomputing them. Only whole pages are cached: a page is the unit the allocator hands out,
the unit transferred between workers and the unit hashed for the Redis prefix index.

Ownership: pages stored in the tree belong to the cache; it gives them back to the `PageAllocator`
only through `evict` and `reset`. Pages of nodes locked by a running request ("protected") are never
given back.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.kv.allocator import PageAllocator

TokenKey = tuple[int, ...]


def _empty_pages() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree plus the node it leads to.

    `eq=False` keeps identity hashing, so nodes can sit in sets and be compared with `is`.
    `block_hashes` is either parallel to `pages` or empty (inserted without hashes).
    """

    key: TokenKey = ()
    pages: torch.Tensor = field(default_factory=_empty_pages)
    block_hashes: list[int] = field(default_factory=list)
    # Keyed by the first page of the child's key: siblings never share a first page, so one dict
    # lookup per edge finds the only candidate.
    children: dict[TokenKey, RadixNode] = field(default_factory=dict, repr=False)
    parent: RadixNode | None = field(default=None, repr=False)
    ref_count: int = 0
    last_access: int = 0

    @property
    def num_pages(self) -> int:
        return int(self.pages.numel())


@dataclass
class MatchResult:
    node: RadixNode  # deepest fully matched node, ending exactly at matched_len (root when nothing matched)
    pages: torch.Tensor  # int64 page ids of the matched tokens, in order
    matched_len: int  # always a multiple of page_size


def _as_tokens(token_ids: Sequence[int] | torch.Tensor) -> TokenKey:
    # Tuples compare and slice in C, which is what makes page-wise key comparison cheap; going
    # through tolist() avoids creating one 0-d tensor per element for tensor/ndarray input.
    if isinstance(token_ids, tuple):
        return token_ids
    tolist = getattr(token_ids, "tolist", None)
    if tolist is not None:
        return tuple(tolist())
    return tuple(token_ids)


class RadixCache:
    def __init__(self, page_size: int, allocator: PageAllocator) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self.allocator = allocator
        self.root = RadixNode()
        # Kept incrementally so metrics and admission control never walk the tree.
        self._evictable = 0
        self._protected = 0
        # Non-root nodes without children: the only eviction candidates. Tracking them avoids a full
        # tree walk on every evict call.
        self._leaves: set[RadixNode] = set()
        self._evicted_hashes: list[int] = []
        self._clock = 0
        # Tie-breaker for the eviction heap: nodes themselves are not orderable.
        self._seq = itertools.count()

    # ---- counters -------------------------------------------------------------------------------

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    @property
    def cached_pages(self) -> int:
        return self._evictable + self._protected

    # ---- lookup ---------------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], max_len: int | None = None) -> MatchResult:
        """Longest page-aligned prefix of `token_ids[:max_len]` in the tree; refreshes LRU stamps on the path.

        Accepts lists, tuples and int tensors. Does not lock: the caller locks `node` if it reuses the pages.
        """
        tokens = _as_tokens(token_ids)
        if max_len is not None:
            tokens = tokens[: max(max_len, 0)]
        limit = len(tokens) // self.page_size * self.page_size
        tick = self._tick()

        node = self.root
        pos = 0
        chunks: list[torch.Tensor] = []
        while pos < limit:
            child = node.children.get(tokens[pos : pos + self.page_size])
            if child is None:
                break
            matched = self._matched_tokens(child.key, tokens, pos, limit)
            if matched < len(child.key):
                # Split so the returned node ends exactly at matched_len: the caller locks it, and a
                # lock must cover exactly the pages it reuses.
                child = self._split(child, matched // self.page_size)
            child.last_access = tick
            chunks.append(child.pages)
            node = child
            pos += matched

        pages = torch.cat(chunks) if chunks else _empty_pages()
        return MatchResult(node=node, pages=pages, matched_len=pos)

    # ---- locking --------------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        self._check_attached(node)
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
        # Ancestors always hold at least the node's count, so checking the node alone guarantees no
        # ancestor underflows and nothing is half-decremented when we raise.
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

    # ---- insertion ------------------------------------------------------------------------------

    def insert(
        self,
        token_ids: Sequence[int],
        pages: torch.Tensor,
        block_hashes: Sequence[int] | None = None,
    ) -> tuple[int, RadixNode]:
        """Caches the page-aligned prefix of `token_ids` backed by `pages`.

        Returns `(already_cached_len, last_node)`. The cache takes ownership of
        `pages[already_cached_len // page_size : n]` only; the caller keeps the rest of what it
        passed (the already-cached range, where the tree keeps its own pages, and anything past `n`).
        """
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
                self._leaves.discard(node)
                self._leaves.add(leaf)
                self._evictable += leaf.num_pages
                return pos, leaf
            matched = self._matched_tokens(child.key, tokens, pos, limit)
            if matched < len(child.key):
                child = self._split(child, matched // ps)
            child.last_access = tick
            node = child
            pos += matched
        return pos, node

    # ---- eviction -------------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        if num_pages <= 0:
            return 0
        heap = [(leaf.last_access, next(self._seq), leaf) for leaf in self._leaves if leaf.ref_count == 0]
        heapq.heapify(heap)
        freed = 0
        to_free: list[torch.Tensor] = []
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self._detach_leaf(leaf)
            to_free.append(leaf.pages)
            freed += leaf.num_pages
            if parent is not self.root and not parent.children and parent.ref_count == 0:
                heapq.heappush(heap, (parent.last_access, next(self._seq), parent))
        if to_free:
            # One allocator call: its double-free check is a tensor op, cheaper batched.
            self.allocator.free(torch.cat(to_free))
        return freed

    def drain_evicted_hashes(self) -> list[int]:
        out, self._evicted_hashes = self._evicted_hashes, []
        return out

    def all_block_hashes(self) -> list[int]:
        out: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.block_hashes)
            stack.extend(node.children.values())
        return out

    def reset(self) -> None:
        """Gives every cached page back to the allocator; their hashes go to the evicted list."""
        if self._protected:
            raise RuntimeError("RadixCache.reset: nodes are still locked")
        to_free: list[torch.Tensor] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            to_free.append(node.pages)
            self._evicted_hashes.extend(node.block_hashes)
            stack.extend(node.children.values())
            # Detach so a stale reference held by a caller fails loudly in lock() instead of
            # resurrecting freed pages.
            node.parent = None
            node.children = {}
        self.root.children = {}
        self._leaves.clear()
        self._evictable = 0
        if to_free:
            self.allocator.free(torch.cat(to_free))

    # ---- internals ------------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _matched_tokens(self, key: TokenKey, tokens: TokenKey, pos: int, limit: int) -> int:
        """Tokens of `key` matching `tokens[pos:limit]`, rounded down to whole pages.

        The caller already found `key` by its first page, so the result is at least one page.
        """
        ps = self.page_size
        span = min(len(key), limit - pos)
        # Fast path: one C-level comparison covers the common case of a full edge match.
        if tokens[pos : pos + span] == key[:span]:
            return span
        off = ps
        while off < span and tokens[pos + off : pos + off + ps] == key[off : off + ps]:
            off += ps
        return off

    def _split(self, node: RadixNode, at_pages: int) -> RadixNode:
        """Splits `node` after `at_pages` pages and returns the new upper half.

        The original object keeps the lower half so that it still ends at the same depth: callers
        holding it (locked or as `last_node`) keep referring to the same token range.
        """
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
            # Every lock through `node` also passes through its new ancestor, and both halves keep
            # the same lock state, so the evictable/protected counters need no change.
            ref_count=node.ref_count,
            last_access=node.last_access,
        )
        node.key = node.key[cut:]
        node.pages = node.pages[at_pages:].clone()
        node.block_hashes = node.block_hashes[at_pages:]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        parent.children[upper.key[:ps]] = upper
        return upper

    def _detach_leaf(self, leaf: RadixNode) -> None:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.ref_count == 0
        del parent.children[leaf.key[: self.page_size]]
        leaf.parent = None
        self._leaves.discard(leaf)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)
        self._evictable -= leaf.num_pages
        self._evicted_hashes.extend(leaf.block_hashes)

    def _check_attached(self, node: RadixNode) -> None:
        if node is not self.root and node.parent is None:
            raise RuntimeError("RadixCache: node was evicted or reset")
