from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.kv.page_table import PageTable
from common.kv.radix import MatchResult
from common.sched.pages import KVBudget
from common.sched.request import Req
from common.sched.step_plan import chunk_size


@dataclass
class PrefillAdder:
    """Executes a step plan's prompt chunks (common/sched/step_plan.py) under two budgets: tokens computed this
    step, and KV pages (each admitted request reserves `KVBudget.reserve_len`). The plan decided them; this
    takes the prefix hits and pages, and stops short where the cache changed under the plan."""

    budget: KVBudget
    page_table: PageTable
    token_budget: int
    pages_available: int
    running_slots: int
    batch: list[Req] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)

    def _chunk_size(self, req: Req, tokens: int) -> int:
        # Chunks end on page boundaries so every chunk's pages are complete when it is sent onwards.
        return chunk_size(req.device_len - req.cached_len, min(tokens, self.token_budget), self.budget.page_size)

    def add_continuing(self, req: Req, tokens: int) -> bool:
        """Next chunk, of at most `tokens`, of a request admitted in an earlier step (its pages are reserved)."""
        n = self._chunk_size(req, tokens)
        if n <= 0:
            return False
        self._take(req, n)
        return True

    def try_admit(self, req: Req, tokens: int) -> bool:
        """Admits a waiting request with a first chunk of at most `tokens` if a table row, its pages and some of
        the token budget are available."""
        if self.running_slots <= 0 or self.page_table.num_free_rows == 0:
            return False
        if req.parked is not None:
            return self._resume_parked(req, tokens)
        cache = self.budget.cache
        node, matched_pages, matched_len, locked_now = None, [], 0, 0
        m: MatchResult | None = None
        if cache is not None:
            m = cache.match_prefix(req.fill_ids(), max_len=req.cache_match_limit)
            node, matched_len, matched_pages = m.node, m.matched_len, m.pages.tolist()
            before = cache.evictable_pages
            cache.lock(node)
            locked_now = before - cache.evictable_pages  # locking shrinks what eviction can reclaim
        # Pages of a host-tier hit come out of this same budget: they are loaded into fresh device pages.
        reserve = self.budget.reserve_len(req)
        need = self.budget.pages_for(reserve) - len(matched_pages)
        if need > self.pages_available - locked_now:
            if cache is not None:
                cache.unlock(node)
            return False
        if cache is not None and m is not None and m.host_nodes:
            loaded = cache.load_back(m)
            cache.lock(loaded.node)
            cache.unlock(node)
            node, matched_len, matched_pages = loaded.node, loaded.matched_len, loaded.pages.tolist()
        first_chunk = min(req.device_len - matched_len, tokens, self.token_budget)
        if first_chunk < req.device_len - matched_len and first_chunk < self.budget.page_size:
            if cache is not None:
                cache.unlock(node)
            return False
        req.table_row = self.page_table.take_row()
        req.pages = matched_pages
        req.tree_pages = len(matched_pages)
        req.cache_node = node
        req.cached_len = matched_len
        req.reserve_len = reserve
        if not req.output_ids:  # a resumed request reports the hit of its first admission
            req.prefix_hit_len = matched_len
        self.page_table.write_pages(req.table_row, 0, torch.tensor(matched_pages, dtype=torch.int64))
        self.pages_available -= need + locked_now
        self.running_slots -= 1
        self._take(req, self._chunk_size(req, tokens))
        return True

    def _resume_parked(self, req: Req, tokens: int) -> bool:
        """A parked request's KV comes back from the host tier into fresh pages of its reservation; what is left
        to compute is the token(s) sampled since its KV was taken, as a decode step would have."""
        assert req.parked is not None
        reserve = self.budget.reserve_len(req)
        need = self.budget.pages_for(reserve)
        remaining = req.device_len - req.parked.tokens
        first_chunk = min(remaining, tokens, self.token_budget)
        if need > self.pages_available or (first_chunk < remaining and first_chunk < self.budget.page_size):
            return False
        req.table_row = self.page_table.take_row()
        req.reserve_len = reserve
        self.budget.unpark(req)
        self.pages_available -= need
        self.running_slots -= 1
        self._take(req, self._chunk_size(req, tokens))
        return True

    def _take(self, req: Req, n: int) -> None:
        self.budget.grow(req, req.cached_len + n)
        self.batch.append(req)
        self.chunks.append(n)
        self.token_budget -= n
