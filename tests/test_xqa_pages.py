"""The dense page table and lengths a decode graph derives for XQA's FP8 kernel (common/engine/gpu/xqa_decode.py)
from flashinfer's CSR description, on the CPU: the kernel itself runs in tests/test_gpu_kernels.py."""

from __future__ import annotations

import torch

from common.engine.gpu.attention import PageMeta
from common.engine.gpu.xqa_decode import dense_pages


def test_dense_pages_match_each_rows_pages_and_length_with_padding_rows():
    ps, width, dummy = 16, 8, 999
    lens = [1, 16, 17, 100, 128]
    npages = [-(-n // ps) for n in lens]
    indptr = torch.tensor([0, *torch.tensor(npages).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randperm(500)[: sum(npages)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(lens, npages)], dtype=torch.int32)
    meta = PageMeta(indptr, ids, last).padded(7, dummy)  # two padding rows on the dummy page, as a graph pads
    buf = torch.zeros(7 * width + 7, dtype=torch.int32)  # the graph's longer buffer
    buf[: meta.indices.numel()] = meta.indices
    table, seq = dense_pages(meta.indptr, buf, meta.last_page_len, torch.arange(width), ps)
    assert table.shape == (7, width) and table.dtype == torch.int32
    assert seq.shape == (7, 1) and seq.flatten().tolist() == [*lens, 1, 1]
    for i, n in enumerate(npages):
        assert table[i, :n].tolist() == ids[int(indptr[i]) : int(indptr[i + 1])].tolist()
    assert table[5:, 0].tolist() == [dummy, dummy]
