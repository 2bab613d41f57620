"""The idle page-ledger check on a real allocator and radix cache: a clean ledger passes, and each way of
breaking it (a leak, a page held twice, a freed page still in use) is named."""

from __future__ import annotations

import torch

from common.kv.allocator import PageAllocator
from common.kv.integrity import IdleLedgerCheck, page_ledger_violations
from common.kv.radix import RadixCache

PAGE = 4


def _ledger() -> tuple[PageAllocator, RadixCache, list[int], list[int]]:
    """A 16-page pool: a cached 2-page prefix shared by a request that owns 3 pages of its own beyond it."""
    alloc = PageAllocator(16)
    cache = RadixCache(PAGE, alloc)
    prefix = alloc.alloc(2)
    assert prefix is not None
    cache.insert(list(range(2 * PAGE)), prefix)
    own = alloc.alloc(3)
    assert own is not None
    return alloc, cache, prefix.tolist(), own.tolist()


def test_clean_ledger_passes() -> None:
    alloc, cache, prefix, own = _ledger()
    assert page_ledger_violations(alloc, cache, [(prefix + own, 2)]) == []
    assert page_ledger_violations(PageAllocator(8), None, []) == []


def test_leaked_pages_are_found() -> None:
    alloc, cache, prefix, own = _ledger()
    problems = page_ledger_violations(alloc, cache, [])  # the request's own pages are lost
    assert any("!= total 16" in p for p in problems), problems


def test_page_held_twice_is_found() -> None:
    alloc, cache, prefix, own = _ledger()
    problems = page_ledger_violations(alloc, cache, [(prefix + own, 2), ([own[0]], 0)])
    assert any("held twice" in p for p in problems), problems
    # a request claiming a cached page as its own is the same bug
    problems = page_ledger_violations(alloc, cache, [(prefix + own, 2), ([prefix[0]], 0)])
    assert any("held twice" in p for p in problems), problems


def test_freed_page_still_in_use_is_found() -> None:
    alloc, cache, prefix, own = _ledger()
    alloc.free(torch.tensor([own[1]]))
    problems = page_ledger_violations(alloc, cache, [(prefix + own, 2)])
    assert any("free pages are also held" in p for p in problems), problems


def test_idle_check_runs_once_per_idle_spell() -> None:
    alloc, cache, prefix, own = _ledger()
    check = IdleLedgerCheck()
    assert check(True, lambda: page_ledger_violations(alloc, cache, [])) != []  # leak found
    assert check(True, lambda: page_ledger_violations(alloc, cache, [])) == []  # same idle spell: not checked again
    assert check(False, lambda: page_ledger_violations(alloc, cache, [])) == []
    assert check(True, lambda: page_ledger_violations(alloc, cache, [(prefix + own, 2)])) == []
