from __future__ import annotations

import numpy as np
import torch


class PageTable:
    """Per-request rows of raw token locations (`page * page_size + offset`: a token's write slot is one lookup),
    plus table-row bookkeeping. Writes wait on the host and reach the device with the next step's one copy
    (`take_writes`); `table` read from outside applies what is pending first."""

    def __init__(
        self, max_rows: int, max_seq_len: int, page_size: int, device: torch.device, host_pages: bool = False
    ) -> None:
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        # One spare row so CUDA-graph padding has a row of its own to point at.
        self._table = torch.zeros((max_rows + 1, max_seq_len), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._offsets = torch.arange(page_size, dtype=torch.int32, device=device)
        # (flat index of the page's first slot, page id) of writes not yet applied, in write order.
        self._pending_at: list[np.ndarray] = []
        self._pending_pages: list[np.ndarray] = []
        # Tensor parallelism: rank 0 records its writes to ship with the next step (None: not recorded).
        self.journal: list[tuple[int, int, torch.Tensor]] | None = None
        # Every row's page ids on the host too, for flashinfer's MLA planner (a device read would sync).
        self.host_pages = np.zeros((max_rows + 1, -(-max_seq_len // page_size)), dtype=np.int32) if host_pages else None

    @property
    def table(self) -> torch.Tensor:
        if self._pending_at:
            at, pages = self.take_writes()
            dev = torch.from_numpy(np.stack((at, pages))).to(self._table.device, non_blocking=True)
            self.apply_writes(dev[0], dev[1])
        return self._table

    def drain_journal(self) -> list[tuple[int, int, torch.Tensor]]:
        out, self.journal = self.journal or [], ([] if self.journal is not None else None)
        return out

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def take_row(self) -> int:
        return self._free_rows.pop()

    def give_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write_pages(self, row: int, first_page_index: int, pages: torch.Tensor) -> None:
        if pages.numel() == 0:
            return
        pages = pages.to(torch.int64)
        if self.journal is not None:
            self.journal.append((row, first_page_index, pages))
        first = row * self.max_seq_len + first_page_index * self.page_size
        self._pending_at.append(first + self.page_size * np.arange(pages.numel(), dtype=np.int64))
        self._pending_pages.append(pages.numpy().copy())
        if self.host_pages is not None:
            self.host_pages[row, first_page_index : first_page_index + pages.numel()] = self._pending_pages[-1]

    def take_writes(self) -> tuple[np.ndarray, np.ndarray]:
        """The pending writes, taken: (flat index of each page's first slot, page id), the last write of a
        range kept."""
        at = np.concatenate(self._pending_at) if self._pending_at else np.zeros(0, dtype=np.int64)
        pages = np.concatenate(self._pending_pages) if self._pending_pages else np.zeros(0, dtype=np.int64)
        self._pending_at, self._pending_pages = [], []
        if len(at) > 1:
            last = len(at) - 1 - np.unique(at[::-1], return_index=True)[1]
            if len(last) < len(at):
                keep = np.sort(last)
                at, pages = at[keep], pages[keep]
        return at, pages

    def apply_writes(self, at: torch.Tensor, pages: torch.Tensor) -> None:
        """Writes taken pages into the table: two kernels for any number of pages."""
        if at.numel() == 0:
            return
        slots = (at[:, None] + self._offsets[None, :]).view(-1)
        locs = (pages.to(torch.int32)[:, None] * self.page_size + self._offsets[None, :]).view(-1)
        self._table.view(-1).index_copy_(0, slots, locs)
