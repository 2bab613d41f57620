"""Host-to-device staging (common/engine/staging.py) and the page table's staged writes."""

from __future__ import annotations

import numpy as np
import torch

from common.engine.staging import HostToDevice
from common.kv.page_table import PageTable

CPU = torch.device("cpu")


def test_a_stage_sends_every_part_in_one_copy_and_its_tensors_outlive_later_stages() -> None:
    h2d = HostToDevice(CPU, slots=2, capacity=32)  # small: the parts below make the buffer grow
    kept = []
    for step in range(5):
        stage = h2d.stage()
        ids = stage.put([step, 2**40 + step, -1], torch.int64)
        mask_part, mask = stage.reserve((2, 3), torch.int32)
        mask.copy_(torch.arange(6, dtype=torch.int32).view(2, 3) * (step + 1))  # filled in place
        scale = stage.put(np.array([0.5, step], dtype=np.float32), torch.float32)
        flags = stage.put(torch.tensor([True, step % 2 == 0]), torch.bool)
        empty = stage.put([], torch.int64)
        sent = stage.send()
        kept.append((step, sent[ids], sent[mask_part], sent[scale], sent[flags], sent[empty]))
    assert h2d.copies == 5
    for step, ids, mask, scale, flags, empty in kept:  # buffers were reused and grown since: still intact
        assert ids.tolist() == [step, 2**40 + step, -1]
        assert torch.equal(mask, torch.arange(6, dtype=torch.int32).view(2, 3) * (step + 1))
        assert scale.tolist() == [0.5, float(step)] and flags.tolist() == [True, step % 2 == 0]
        assert empty.numel() == 0 and ids.dtype == torch.int64 and mask.dtype == torch.int32


def test_page_table_writes_wait_for_the_step_and_the_last_write_of_a_page_wins() -> None:
    table = PageTable(max_rows=3, max_seq_len=16, page_size=4, device=CPU)
    table.write_pages(0, 0, torch.tensor([5, 6]))
    table.write_pages(1, 1, torch.tensor([9]))
    table.write_pages(0, 1, torch.tensor([7]))  # row 0 given back and retaken: its second page rewritten
    at, pages = table.take_writes()
    assert at.tolist() == [0, 16 + 4, 4] and pages.tolist() == [5, 9, 7]
    assert table.take_writes()[0].size == 0
    table.apply_writes(torch.from_numpy(at), torch.from_numpy(pages))
    assert table.table[0, :8].tolist() == [20, 21, 22, 23, 28, 29, 30, 31]
    assert table.table[1, 4:8].tolist() == [36, 37, 38, 39]
    table.write_pages(2, 2, torch.tensor([1]))
    assert table.table[2, 8:12].tolist() == [4, 5, 6, 7]  # read from outside a step: applied first
