from __future__ import annotations

import torch

from common.kv.allocator import PageAllocator
from common.kv.page_table import PageTable
from common.kv.radix import RadixCache
from common.sched.request import ParkedKV, Req
from common.sched.step_plan import PrefixPeek

# Optimistic reservation's decode pages beyond the prompt: a fresh or resumed request decodes a while before it
# needs spare pages, so a full pool preempts at long outputs' page boundaries, not at every admission.
DECODE_ALLOWANCE_PAGES = 2


class KVBudget:
    """Page accounting shared by admission and allocation (evicting unlocked prefix-cache pages when short), under
    the memory policy (docs/architecture.md, "The scheduler loop"): `full` reserves prompt and max_tokens;
    `optimistic` the prompt and DECODE_ALLOWANCE_PAGES, growing from spare pages (grammar requests: in full). A
    preempted request's KV is parked in the host tier or left to the prefix cache (`preempt`)."""

    def __init__(
        self, allocator: PageAllocator, cache: RadixCache | None, page_table: PageTable, reservation: str = "full"
    ) -> None:
        if reservation not in ("full", "optimistic"):
            raise ValueError(f"kv reservation must be full or optimistic, not {reservation!r}")
        self.allocator = allocator
        self.cache = cache
        self.page_table = page_table
        self.page_size = page_table.page_size
        self.optimistic = reservation == "optimistic"

    def reserve_len(self, req: Req) -> int:
        """Tokens whose pages `req` reserves when admitted (from its present length)."""
        if not self.optimistic or req.sampling.grammar is not None:
            return req.max_device_len
        if req.prefill_only:
            return req.device_len
        return min(req.max_device_len, req.device_len + DECODE_ALLOWANCE_PAGES * self.page_size)

    @property
    def reserve_output_tokens(self) -> int:
        """Output tokens reserved beyond the prompt (0: all of max_tokens), as /load publishes it."""
        return DECODE_ALLOWANCE_PAGES * self.page_size if self.optimistic else 0

    def reserved_pages(self, active: list[Req]) -> int:
        return sum(max(0, self.pages_for(r.reserve_len) - len(r.pages)) for r in active)

    def peek(self, req: Req) -> PrefixPeek:
        """The prefix hit `req` would take now, unlocked (LRU stamps refreshed); at least one token is left to compute."""
        cache = self.cache
        if req.parked is not None:
            return PrefixPeek(req.parked.tokens)  # all of it comes back into fresh pages
        if cache is None:
            return PrefixPeek()
        m = cache.match_prefix(req.fill_ids(), max_len=req.cache_match_limit)
        lock, node = 0, m.node
        while node is not cache.root and node is not None:
            if node.ref_count == 0:
                lock += node.num_pages
            node = node.parent
        return PrefixPeek(m.matched_len + m.host_len, int(m.pages.numel()), lock)

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
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return
        pages = self.alloc(need)
        self.page_table.write_pages(req.table_row, len(req.pages), pages)
        req.pages.extend(pages.tolist())

    def preempt(self, req: Req, park: bool) -> bool:
        """Frees a running request's pages and table row. With `park`, its KV is first copied to the host tier
        (one copy per run of pages) when the tier can hold it: True, parked. Otherwise its whole pages go to the
        prefix cache, where a readmission finds what eviction has left of them."""
        parked = park and self._park(req)
        if not parked:
            self.cache_prefix(req, req.cached_len)
        self._release_device(req)
        return parked

    def _park(self, req: Req) -> bool:
        cache = self.cache
        n = self.pages_for(req.cached_len)
        host_pages = cache.take_host_pages(n) if cache is not None else None
        if host_pages is None or cache is None or cache.host is None:
            return False
        cache.host.save(torch.tensor(req.pages[:n], dtype=torch.int64), host_pages)
        req.parked = ParkedKV(host_pages, req.cached_len)
        return True

    def unpark(self, req: Req) -> None:
        """Copies a parked request's KV back into fresh pages of its (new, empty) table row; the pages come out
        of the admission's reservation."""
        parked, req.parked = req.parked, None
        assert parked is not None and not req.pages and self.cache is not None and self.cache.host is not None
        self.grow(req, parked.tokens)
        host = self.cache.host
        host.load(parked.host_pages, torch.tensor(req.pages, dtype=torch.int64))
        host.allocator.free(parked.host_pages)
        req.cached_len = parked.tokens

    def release(self, req: Req) -> None:
        """Returns the request's own pages, host-tier pages and table row, and unlocks its prefix-cache node."""
        self._release_device(req)
        if req.parked is not None:
            assert self.cache is not None and self.cache.host is not None
            self.cache.host.allocator.free(req.parked.host_pages)
            req.parked = None

    def _release_device(self, req: Req) -> None:
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
        """Inserts the request's first `num_tokens` tokens (page-aligned down) into the prefix cache; the row is
        re-pointed at the tree's pages before duplicates are freed, so no entry points at a freed page."""
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
