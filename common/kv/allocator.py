from __future__ import annotations

import torch


class PageAllocator:
    """Hands out KV page ids from a fixed pool, at a cost proportional to the pages asked for (never to the
    pool's size: a 100 GB pool has ~50k pages and a decode step allocates one now and then).

    Free pages sit on a stack. Freed pages are pushed highest id first, so a later allocation pops them back
    in ascending order: a request's pages tend to come back as one run of consecutive ids, which are adjacent
    in the pool tensor and coalesce into one transfer descriptor per layer. The fresh pool pops 0, 1, 2, ...
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        self._stack: list[int] = list(range(num_pages - 1, -1, -1))
        self._free = torch.ones(num_pages, dtype=torch.bool)  # membership, for double-free checks

    @property
    def num_free(self) -> int:
        return len(self._stack)

    def alloc(self, n: int) -> torch.Tensor | None:
        """Returns `n` page ids (int64) or None when fewer than `n` are free."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._stack):
            return None
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        taken = self._stack[-n:]
        del self._stack[-n:]
        taken.reverse()
        pages = torch.tensor(taken, dtype=torch.int64)
        self._free[pages] = False
        return pages

    def free(self, pages: torch.Tensor) -> None:
        if pages.numel() == 0:
            return
        pages = pages.to(torch.int64).flatten()
        if bool(self._free[pages].any()) or pages.unique().numel() != pages.numel():
            raise RuntimeError("double free of KV pages")
        self._free[pages] = True
        self._stack.extend(sorted(pages.tolist(), reverse=True))

    def is_free(self, pages: torch.Tensor) -> torch.Tensor:
        return self._free[pages.to(torch.int64)]
