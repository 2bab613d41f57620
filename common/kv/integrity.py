"""The page ledger check a worker runs when idle (one pass over pool and tree): every page is free, cached or
owned by one live request (free + cached + owned == total), and every host-tier page is free, cached or parked
(a preempted request's KV: free + cached + parked == its total). A violation would give one page two writers or
leak it; the worker logs and counts it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from common.kv.allocator import PageAllocator
from common.kv.radix import RadixCache

log = logging.getLogger("kvferry.kv")


def tree_pages(cache: RadixCache, host: bool = False) -> torch.Tensor:
    """Every device page (host-tier page with `host`) the radix cache holds."""
    chunks = []
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        if node.on_host == host:
            chunks.append(node.pages.to(torch.int64))
        stack.extend(node.children.values())
    return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64)


def host_tier_violations(cache: RadixCache, parked: torch.Tensor | None = None) -> list[str]:
    """What is wrong with the host tier's ledger and the tiers' order in the tree (empty: nothing). `parked`:
    the host pages preempted requests own."""
    host = cache.host
    if host is None:
        return [] if parked is None or not parked.numel() else ["requests own host pages, and there is no host tier"]
    problems = []
    tree = tree_pages(cache, host=True)
    held = tree if parked is None else torch.cat([tree, parked.to(torch.int64)])
    total = host.allocator.num_pages
    if held.numel() and (int(held.min()) < 0 or int(held.max()) >= total):
        return [f"host page ids outside the host pool [0, {total}) are held"]
    counts = torch.bincount(held, minlength=total)
    if bool((counts > 1).any()):
        problems.append(f"{int((counts > 1).sum())} host pages held twice")
    if bool((host.allocator.is_free(torch.arange(total)) & (counts > 0)).any()):
        problems.append("free host pages are also held")
    if cache.host_cached_pages != tree.numel():
        problems.append(f"radix cache counts {cache.host_cached_pages} host pages, its tree holds {tree.numel()}")
    if host.allocator.num_free + held.numel() != total:
        problems.append(
            f"host tier: free {host.allocator.num_free} + cached {tree.numel()} + parked "
            f"{held.numel() - tree.numel()} != total {total} pages"
        )
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        if node.on_host and (node.ref_count or any(not c.on_host for c in node.children.values())):
            problems.append("a host-tier node is locked or has device children")
            break
        stack.extend(node.children.values())
    return problems


def page_ledger_violations(
    allocator: PageAllocator,
    cache: RadixCache | None,
    requests: Iterable[tuple[Sequence[int], int]],
    parked: Iterable[torch.Tensor] = (),
) -> list[str]:
    """What is wrong with the page ledger (empty: nothing). `requests`: each live request's pages and how many
    leading ones belong to the radix cache; `parked`: the host-tier pages of each parked request."""
    total = allocator.num_pages
    tree = tree_pages(cache) if cache is not None else torch.empty(0, dtype=torch.int64)
    owned_lists, shared_lists = [], []
    for pages, in_tree in requests:
        owned_lists.append(torch.as_tensor(list(pages[in_tree:]), dtype=torch.int64))
        shared_lists.append(torch.as_tensor(list(pages[:in_tree]), dtype=torch.int64))
    owned = torch.cat(owned_lists) if owned_lists else torch.empty(0, dtype=torch.int64)
    shared = torch.cat(shared_lists) if shared_lists else torch.empty(0, dtype=torch.int64)

    problems = []
    held = torch.cat([tree, owned])
    if held.numel() and (int(held.min()) < 0 or int(held.max()) >= total):
        return [f"page ids outside the pool [0, {total}) are held"]
    free = allocator.is_free(torch.arange(total, dtype=torch.int64))
    if int(free.sum()) != allocator.num_free:
        problems.append(f"allocator counts {allocator.num_free} free pages, its map has {int(free.sum())}")
    counts = torch.bincount(held, minlength=total)
    if bool((counts > 1).any()):
        twice = torch.nonzero(counts > 1).flatten()
        problems.append(f"{twice.numel()} pages held twice (e.g. {twice[:8].tolist()})")
    free_and_held = free & (counts > 0)
    if bool(free_and_held.any()):
        ids = torch.nonzero(free_and_held).flatten()
        problems.append(f"{ids.numel()} free pages are also held (e.g. {ids[:8].tolist()})")
    if shared.numel() and not bool(torch.isin(shared, tree).all()):
        problems.append("a request's prefix pages are not in the radix cache")
    if cache is not None and cache.cached_pages != tree.numel():
        problems.append(f"radix cache counts {cache.cached_pages} pages, its tree holds {tree.numel()}")
    if allocator.num_free + tree.numel() + owned.numel() != total:
        problems.append(
            f"free {allocator.num_free} + cached {tree.numel()} + owned {owned.numel()} != total {total} pages"
        )
    parked_lists = [p.to(torch.int64).flatten() for p in parked]
    parked_pages = torch.cat(parked_lists) if parked_lists else torch.empty(0, dtype=torch.int64)
    if cache is not None:
        problems += host_tier_violations(cache, parked_pages)
    elif parked_pages.numel():
        problems.append("requests own host pages, and there is no host tier")
    return problems


@dataclass
class IdleLedgerCheck:
    checked: bool = False

    def __call__(self, idle: bool, violations: Callable[[], list[str]]) -> list[str]:
        if not idle:
            self.checked = False
            return []
        if self.checked:
            return []
        self.checked = True
        problems = violations()
        for p in problems:
            log.error("KV page ledger violated: %s", p)
        return problems
