"""XQA's dense page table from flashinfer's CSR page description, in one launch inside the decode graph (as torch
ops, nine launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["width", "page_size"])
def _dense_pages_kernel(indptr_ptr, indices_ptr, last_ptr, table_ptr, lens_ptr, width, page_size, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(indptr_ptr + b)
    n = tl.load(indptr_ptr + b + 1) - start
    tl.store(lens_ptr + b, (n - 1) * page_size + tl.load(last_ptr + b))
    for c0 in range(0, width, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        ids = tl.load(indices_ptr + start + c, mask=c < n, other=0)  # past the row: page 0, never read
        tl.store(table_ptr + b * width + c, ids, mask=c < width)


def dense_pages(
    indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, width: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense page table [B, width] int32 and lengths [B, 1] int32 from flashinfer's CSR description, with no host
    sync. Entries past a row's last page hold page 0: XQA stops at the row's length."""
    b = last.shape[0]
    table = torch.empty(b, width, dtype=torch.int32, device=indices.device)
    lens = torch.empty(b, 1, dtype=torch.int32, device=indices.device)
    _dense_pages_kernel[(b,)](indptr, indices, last, table, lens, width, page_size, BLOCK=128, num_warps=1)
    return table, lens
