"""Run by tests/test_argmax_interpreted.py under TRITON_INTERPRET=1 (Triton's interpreter, on the CPU): the
two-launch argmax of common/engine/gpu/argmax.py against torch's, on rows that end mid-chunk, ties within a chunk
and across chunks, rows of -inf only, and a NaN; prints one JSON line."""

from __future__ import annotations

import json

import torch

from common.engine.gpu.argmax import CHUNK, argmax_rows


def cases() -> list[dict]:
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


if __name__ == "__main__":
    print(json.dumps(cases()))
