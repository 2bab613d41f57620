"""Registered scratch memory for transfers whose destination rank holds fewer KV heads than the source.

A page-major pool keeps all of a token's heads side by side, so one destination rank's heads are strided
inside every source page: moving them directly would take one descriptor per (page, layer, K/V, token).
Instead the sender packs the destination's heads of each page into this area (one gather on the source
device: the destination's exact page layout), and moves the packed pages as runs, like a direct transfer.

Space is handed out first-fit and comes back when the write that reads it has been released.
"""

from __future__ import annotations

import torch

ALIGN = 256


class StagingArea:
    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.capacity = nbytes
        self.base_addr = self.buf.data_ptr()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted, coalesced

    def alloc(self, nbytes: int) -> int | None:
        """Offset of `nbytes` of free space, or None when no free block is large enough."""
        need = -(-nbytes // ALIGN) * ALIGN
        for i, (off, size) in enumerate(self._free):
            if size >= need:
                if size == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, size - need)
                return off
        return None

    def release(self, offset: int, nbytes: int) -> None:
        size = -(-nbytes // ALIGN) * ALIGN
        blocks = sorted([*self._free, (offset, size)])
        merged: list[tuple[int, int]] = []
        for off, sz in blocks:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((off, sz))
        self._free = merged

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return self.buf[offset : offset + nbytes].view(dtype).view(shape)
