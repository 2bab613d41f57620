from __future__ import annotations

import torch


class PageAllocator:
    """Hands out KV page ids from a fixed pool.

    A multi-page request gets one run of consecutive pages when the pool has one (else the lowest free
    ids): consecutive pages are adjacent in the pool tensor and coalesce into one transfer descriptor per
    layer.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        self._free = torch.ones(num_pages, dtype=torch.bool)
        self._num_free = num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """Returns `n` page ids (int64, ascending) or None when fewer than `n` are free."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > self._num_free:
            return None
        pages = self._contiguous(n) if n > 1 else None
        if pages is None:
            pages = torch.nonzero(self._free, as_tuple=False).flatten()[:n]
        self._free[pages] = False
        self._num_free -= n
        return pages

    def _contiguous(self, n: int) -> torch.Tensor | None:
        """The first run of `n` consecutive free pages, if any: a transfer posts one descriptor per run per
        layer, and posting costs ~10 us per descriptor on the GPU, so whole runs are worth looking for."""
        csum = torch.cumsum(self._free.to(torch.int32), 0)
        window = csum[n - 1 :] - torch.cat((csum.new_zeros(1), csum[:-n]))
        starts = torch.nonzero(window == n, as_tuple=False)
        if starts.numel() == 0:
            return None
        first = int(starts[0, 0])
        return torch.arange(first, first + n, dtype=torch.int64)

    def free(self, pages: torch.Tensor) -> None:
        if pages.numel() == 0:
            return
        pages = pages.to(torch.int64)
        if bool(self._free[pages].any()) or pages.unique().numel() != pages.numel():
            raise RuntimeError("double free of KV pages")
        self._free[pages] = True
        self._num_free += pages.numel()

    def is_free(self, pages: torch.Tensor) -> torch.Tensor:
        return self._free[pages.to(torch.int64)]
