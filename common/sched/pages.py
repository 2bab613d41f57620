from __future__ import annotations

import torch

from common.kv.allocator import PageAllocator
from common.kv.page_table import PageTable
from common.kv.radix import RadixCache
from common.sched.request import Req


class KVBudget:
    """Page accounting shared by admission and allocation: pages come from the free list, evicting
    unlocked prefix-cache pages when it runs short."""

    def __init__(self, allocator: PageAllocator, cache: RadixCache | None, page_table: PageTable) -> None:
        self.allocator = allocator
        self.cache = cache
        self.page_table = page_table
        self.page_size = page_table.page_size

    def available_pages(self) -> int:
        evictable = self.cache.evictable_pages if self.cache is not None else 0
        return self.allocator.num_free + evictable

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> torch.Tensor:
        if n > self.allocator.num_free and self.cache is not None:
            self.cache.evict(n - self.allocator.num_free)
        pages = self.allocator.alloc(n)
        if pages is None:
            raise RuntimeError(f"KV pool exhausted: need {n} pages, {self.allocator.num_free} free")
        return pages

    def grow(self, req: Req, num_tokens: int) -> None:
        """Makes the request's pages cover positions [0, num_tokens)."""
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return
        pages = self.alloc(need)
        self.page_table.write_pages(req.table_row, len(req.pages), pages)
        req.pages.extend(pages.tolist())

    def release(self, req: Req) -> None:
        """Returns the request's own pages and its table row, and unlocks its prefix-cache node."""
        own = req.pages[req.tree_pages :]
        if own:
            self.allocator.free(torch.tensor(own, dtype=torch.int64))
        if req.cache_node is not None and self.cache is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = None
        req.pages = []
        req.tree_pages = 0
        if req.table_row >= 0:
            self.page_table.give_row(req.table_row)
            req.table_row = -1

    def cache_prefix(self, req: Req, num_tokens: int) -> None:
        """Inserts the request's first `num_tokens` tokens (page-aligned down) into the prefix cache.

        Pages another request inserted meanwhile are duplicates: the row is re-pointed at the tree's pages
        before the duplicates are freed, so no table entry ever points at a freed page.
        """
        cache = self.cache
        if cache is None:
            return
        n_pages = min(num_tokens // self.page_size, len(req.pages))
        if n_pages <= req.tree_pages:
            return
        tokens = req.all_token_ids()[: n_pages * self.page_size]
        own = torch.tensor(req.pages[:n_pages], dtype=torch.int64)
        hashes = req.block_hashes[:n_pages] if len(req.block_hashes) >= n_pages else None
        cache.insert(tokens, own, hashes)
        match = cache.match_prefix(tokens)
        tree = match.pages.to(torch.int64)
        assert tree.numel() == n_pages, "a just-inserted prefix must match in full"
        span = slice(req.tree_pages, n_pages)
        dup = own[span] != tree[span]
        if bool(dup.any()):
            self.page_table.write_pages(req.table_row, req.tree_pages, tree[span])
            self.allocator.free(own[span][dup])
        cache.lock(match.node)
        if req.cache_node is not None:
            cache.unlock(req.cache_node)
        req.cache_node = match.node
        req.pages[:n_pages] = tree.tolist()
        req.tree_pages = n_pages
        if hashes is not None:
            cache.note_stored(list(hashes))  # for the Redis prefix index, in order with the cache's own changes
