"""Run by tests/test_small_kernels_interpreted.py under TRITON_INTERPRET=1 (Triton's interpreter, on the CPU):

- the two-launch argmax of common/engine/gpu/argmax.py against torch's, on rows that end mid-chunk, ties within a
  chunk and across chunks, rows of -inf only, and a NaN;
- XQA's dense page table from a CSR page description (common/engine/gpu/xqa_pages.py), with a graph's padding
  rows on the dummy page;

prints one JSON line."""

from __future__ import annotations

import json

import torch

from common.engine.gpu.argmax import CHUNK, argmax_rows
from common.engine.gpu.attention import PageMeta
from common.engine.gpu.xqa_pages import dense_pages


def argmax_cases() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for rows, vocab in ((1, 3 * CHUNK + 17), (3, CHUNK), (5, 2 * CHUNK - 1), (2, 100)):
        x = torch.randn(rows, vocab, generator=g)
        top = float(x.max()) + 1.0
        if rows >= 3:
            x[0, [vocab - 1, vocab // 2]] = top  # a tie across (or within) chunks: the lower id wins
            x[1] = float("-inf")  # nothing allowed: id 0, as torch
            x[2, [5, 9]] = top  # a tie within the first chunk
        got = argmax_rows(x)
        wide = argmax_rows(torch.cat((x, x), dim=1)[:, :vocab])  # a row stride wider than the row
        out.append(
            {
                "rows": rows,
                "vocab": vocab,
                "dtype": "int64" if got.dtype == torch.int64 else str(got.dtype),
                "same": torch.equal(got, x.argmax(-1)) and torch.equal(wide, got),
                "bf16_same": torch.equal(argmax_rows(x.bfloat16()), x.bfloat16().argmax(-1)),
            }
        )
    nan = torch.zeros(1, 2 * CHUNK)
    nan[0, CHUNK + 3] = float("nan")
    out.append({"nan_row": int(argmax_rows(nan)[0]), "nan_id": CHUNK + 3})
    return out


def dense_pages_case() -> dict:
    ps, width, dummy = 16, 8, 999
    lens = [1, 16, 17, 100, 128]
    npages = [-(-n // ps) for n in lens]
    indptr = torch.tensor([0, *torch.tensor(npages).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randperm(500, generator=torch.Generator().manual_seed(0))[: sum(npages)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(lens, npages)], dtype=torch.int32)
    meta = PageMeta(indptr, ids, last).padded(7, dummy)  # two padding rows on the dummy page, as a graph pads
    buf = torch.zeros(7 * width + 7, dtype=torch.int32)  # the graph's longer buffer
    buf[: meta.indices.numel()] = meta.indices
    table, seq = dense_pages(meta.indptr, buf, meta.last_page_len, width, ps)
    rows_match = all(
        table[i, :n].tolist() == ids[int(indptr[i]) : int(indptr[i + 1])].tolist() for i, n in enumerate(npages)
    )
    return {
        "shape": list(table.shape),
        "dtypes": [str(table.dtype), str(seq.dtype)],
        "lens": seq.flatten().tolist(),
        "want_lens": [*lens, 1, 1],
        "rows_match": rows_match,
        "padding_pages": table[5:, 0].tolist(),
        "dummy": dummy,
    }


if __name__ == "__main__":
    print(json.dumps({"argmax": argmax_cases(), "dense_pages": dense_pages_case()}))
