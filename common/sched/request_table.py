"""Every live request of a scheduler, in exactly one index by state (compiling, waiting, prefilling, awaiting
KV, running, held); the one place that moves a request, so a state and its index never disagree. Moves are O(1)
or O(batch), nothing per token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from common.kv.allocator import PageAllocator
from common.kv.integrity import page_ledger_violations
from common.kv.page_table import PageTable
from common.kv.radix import RadixCache
from common.sched.request import Req, ReqState
from common.sched.waiting import WaitingQueue

__all__ = ["DuplicateRequest", "RequestRejected", "RequestTable"]


class RequestRejected(ValueError):
    """A request that can never be served as asked (too long for the context or the KV pool)."""


class DuplicateRequest(RequestRejected):
    """A request id already live here: the same request delivered twice (a resent POST), or a caller's bug."""


@dataclass
class RequestTable:
    by_id: dict[str, Req] = field(default_factory=dict)
    compiling: dict[str, Req] = field(default_factory=dict)
    waiting: WaitingQueue = field(default_factory=WaitingQueue)
    prefilling: dict[str, Req] = field(default_factory=dict)
    chunked: Req | None = None
    awaiting_kv: dict[str, Req] = field(default_factory=dict)
    running: list[Req] = field(default_factory=list)
    held: dict[str, tuple[Req, bool]] = field(default_factory=dict)  # True: cache its prefix when released
    # ITL targets of the running requests (the step's is the tightest).
    decoding_itl: Counter[float] = field(default_factory=Counter)
    preemptions: int = 0  # running requests sent back to the waiting queue
    parked: int = 0  # of those, the ones whose KV was parked in the host tier (the rest are recomputed)

    def _enter(self, req: Req) -> None:
        if req.req_id in self.by_id:
            raise DuplicateRequest(f"duplicate request id {req.req_id!r}")
        self.by_id[req.req_id] = req

    def add_compiling(self, req: Req) -> None:
        self._enter(req)
        req.state = ReqState.COMPILING
        self.compiling[req.req_id] = req

    def add_waiting(self, req: Req) -> None:
        self._enter(req)
        req.state = ReqState.WAITING
        self.waiting.append(req)

    def add_awaiting_kv(self, req: Req) -> None:
        self._enter(req)
        req.state = ReqState.AWAITING_KV
        self.awaiting_kv[req.req_id] = req

    def compiled(self, req: Req) -> None:
        del self.compiling[req.req_id]
        req.state = ReqState.WAITING
        self.waiting.append(req)

    def admit(self, req: Req) -> None:
        """WAITING (the queue's head) -> PREFILLING, with a table row and pages."""
        assert self.waiting and self.waiting[0] is req, "admission follows the queue's order"
        self.waiting.popleft()
        req.state = ReqState.PREFILLING
        self.prefilling[req.req_id] = req

    def take_chunked(self) -> Req | None:
        req, self.chunked = self.chunked, None
        return req

    def set_chunked(self, req: Req) -> None:
        assert self.chunked is None, "one chunked request at a time"
        assert req.state is ReqState.PREFILLING
        self.chunked = req

    def start_running(self, req: Req) -> None:
        if req.state is ReqState.AWAITING_KV:
            del self.awaiting_kv[req.req_id]
        else:
            assert req.state is ReqState.PREFILLING and req is not self.chunked
            del self.prefilling[req.req_id]
        req.state = ReqState.RUNNING
        self.running.append(req)
        self.decoding_itl[req.itl_target_s] += 1

    def preempt(self, req: Req, parked: bool = False) -> None:
        """RUNNING -> WAITING: device pages freed; its KV comes back from the host tier on admission (`parked`)
        or its prompt and outputs are recomputed."""
        self._leave_running(req)
        req.state = ReqState.WAITING
        self.waiting.append(req)
        self.preemptions += 1
        self.parked += int(parked)

    def hold(self, req: Req, cache_kv: bool, state: ReqState | None = None) -> None:
        """Its pages go to a transfer until `release`; `state` (default: as it is) says how it ended."""
        self._leave(req)
        if state is not None:
            req.state = state
        self.held[req.req_id] = (req, cache_kv)

    def end(self, req: Req) -> None:
        """-> FINISHED, out of every index but `by_id` (the caller frees or holds its pages next)."""
        self._leave(req)
        req.state = ReqState.FINISHED

    def forget(self, req: Req) -> None:
        self.held.pop(req.req_id, None)
        self.by_id.pop(req.req_id, None)

    def release(self, req_id: str) -> tuple[Req, bool] | None:
        """A held request's pages are the scheduler's again: (the request, whether to cache its prefix)."""
        held = self.held.pop(req_id, None)
        if held is not None:
            self.by_id.pop(req_id, None)
        return held

    def _leave(self, req: Req) -> None:
        s = req.state
        if s is ReqState.COMPILING:
            self.compiling.pop(req.req_id, None)
        elif s is ReqState.WAITING:
            self.waiting.remove(req)
        elif s is ReqState.PREFILLING:
            self.prefilling.pop(req.req_id, None)
            if self.chunked is req:
                self.chunked = None
        elif s is ReqState.AWAITING_KV:
            self.awaiting_kv.pop(req.req_id, None)
        elif s is ReqState.RUNNING:
            self._leave_running(req)

    def _leave_running(self, req: Req) -> None:
        self.running.remove(req)
        self.decoding_itl[req.itl_target_s] -= 1
        if not self.decoding_itl[req.itl_target_s]:
            del self.decoding_itl[req.itl_target_s]

    def active(self) -> list[Req]:
        """Requests holding a table row and growable pages: prefilling, awaiting KV, running."""
        return [*self.prefilling.values(), *self.awaiting_kv.values(), *self.running]

    def active_count(self) -> int:
        return len(self.prefilling) + len(self.awaiting_kv) + len(self.running)

    def live_ids(self) -> list[str]:
        return [rid for rid, r in self.by_id.items() if rid not in self.held and r.state is not ReqState.FINISHED]

    def violations(
        self,
        allocator: PageAllocator | None = None,
        cache: RadixCache | None = None,
        page_table: PageTable | None = None,
        max_running: int = 0,
    ) -> list[str]:
        """What is wrong with the table and, given the allocator, the page ledger (empty: nothing). Passes over
        the live requests and the pool: for tests and an idle worker, never per step."""
        problems: list[str] = []
        indexed: list[tuple[str, Req]] = [(rid, r) for rid, r in self.compiling.items()]
        indexed += [(r.req_id, r) for r in self.waiting]
        indexed += [*self.prefilling.items(), *self.awaiting_kv.items()]
        indexed += [(r.req_id, r) for r in self.running]
        indexed += [(rid, r) for rid, (r, _) in self.held.items()]
        seen = Counter(rid for rid, _ in indexed)
        if any(n > 1 for n in seen.values()):
            problems.append(f"requests in two indexes: {sorted(rid for rid, n in seen.items() if n > 1)[:8]}")
        if set(seen) != set(self.by_id):
            problems.append(
                f"by_id and the indexes disagree: unindexed {sorted(set(self.by_id) - set(seen))[:8]}, "
                f"unknown {sorted(set(seen) - set(self.by_id))[:8]}"
            )
        expect = (
            [(r, ReqState.COMPILING) for r in self.compiling.values()]
            + [(r, ReqState.WAITING) for r in self.waiting]
            + [(r, ReqState.PREFILLING) for r in self.prefilling.values()]
            + [(r, ReqState.AWAITING_KV) for r in self.awaiting_kv.values()]
            + [(r, ReqState.RUNNING) for r in self.running]
        )
        wrong = [r.req_id for r, s in expect if r.state is not s]
        if wrong:
            problems.append(f"requests whose state is not their index's: {wrong[:8]}")
        if self.chunked is not None and self.prefilling.get(self.chunked.req_id) is not self.chunked:
            problems.append("the chunked request is not prefilling")
        itl = Counter(r.itl_target_s for r in self.running)
        if itl != self.decoding_itl:
            problems.append("the running requests' ITL targets are miscounted")
        for r in [*self.compiling.values(), *self.waiting]:
            if r.table_row != -1 or r.pages or r.cache_node is not None:
                problems.append(f"{r.req_id}: queued, yet holds a table row or pages")
                break
        active = self.active()
        for r in active:
            if r.table_row < 0 or len(r.pages) * (page_table.page_size if page_table else 1) < r.cached_len:
                problems.append(f"{r.req_id}: active without a table row or pages covering its KV")
                break
            if r.device_len != r.prompt_len + len(r.output_ids):
                problems.append(f"{r.req_id}: device_len is not prompt + outputs")
                break
        rows = [r.table_row for r in active] + [r.table_row for r, _ in self.held.values() if r.table_row >= 0]
        if len(set(rows)) != len(rows):
            problems.append("a table row held by two requests")
        if page_table is not None:
            if max_running and page_table.num_free_rows + len(rows) != max_running:
                problems.append(f"table rows: {page_table.num_free_rows} free + {len(rows)} held != {max_running}")
            ps = page_table.page_size
            for r in active:
                if not r.pages:
                    continue
                row = page_table.table[r.table_row, : len(r.pages) * ps].view(-1, ps).to(torch.int64)
                if row[:, 0].div(ps, rounding_mode="floor").tolist() != r.pages:
                    problems.append(f"{r.req_id}: its table row does not point at its pages")
                    break
        if max_running and self.active_count() > max_running:
            problems.append(f"{self.active_count()} active requests, more than max_running {max_running}")
        if allocator is not None:
            owners = ((r.pages, r.tree_pages) for r in self.by_id.values())
            parked = [r.parked.host_pages for r in self.by_id.values() if r.parked is not None]
            problems += page_ledger_violations(allocator, cache, owners, parked)
        if any(r.parked is not None for r in active):
            problems.append("an admitted request still holds parked KV")
        return problems
