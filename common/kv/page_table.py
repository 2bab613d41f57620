from __future__ import annotations

import torch


class PageTable:
    """Per-request rows of raw token locations (`page * page_size + offset`), plus table-row bookkeeping.

    Rows hold token locations rather than page ids so the KV write slot of token `pos` is one lookup,
    `table[row, pos]`; kernels that want page ids read every page_size-th entry.
    """

    def __init__(self, max_rows: int, max_seq_len: int, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        # One spare row so CUDA-graph padding has a row of its own to point at.
        self.table = torch.zeros((max_rows + 1, max_seq_len), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._offsets = torch.arange(page_size, dtype=torch.int32)
        # Tensor parallelism: rank 0 records its writes here and ships them with the next step, so every
        # rank's table (and so every rank's attention) addresses the same pages. None: not recorded.
        self.journal: list[tuple[int, int, torch.Tensor]] | None = None

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
        if self.journal is not None:
            self.journal.append((row, first_page_index, pages.to("cpu", torch.int64)))
        locs = (pages.to(torch.int32)[:, None] * self.page_size + self._offsets[None, :]).flatten()
        start = first_page_index * self.page_size
        # Non-blocking: on CUDA a blocking host-to-device copy would wait for every step already queued.
        self.table[row, start : start + locs.numel()] = locs.to(self.table.device, non_blocking=True)
