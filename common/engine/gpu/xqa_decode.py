"""Decode attention over FP8 pages on Hopper through flashinfer's XQA kernel (QK^T and PV on FP8 tensor cores;
flashinfer's paged decode reads e4m3 pages barely faster than bf16). It takes a dense page table, derived from
the CSR buffers inside the graph. Its one scale covers K and V, so K's rides on Q's: q_scale = k / v, kv_scale = v.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEMAPHORE_BYTES = 8 << 20
SCRATCH_BYTES = 128 << 20


def supported(device: torch.device, kv_dtype: torch.dtype, page_size: int, head_dim: int) -> bool:
    """Hopper, e4m3 pages, a page and head size the kernel is built for, and flashinfer's module there."""
    if device.type != "cuda" or kv_dtype != torch.float8_e4m3fn or page_size not in (16, 32, 64, 128):
        return False
    if torch.cuda.get_device_capability(device)[0] != 9 or head_dim > 256:
        return False
    try:
        import flashinfer.xqa  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class XqaPages:
    table: torch.Tensor
    lens: torch.Tensor


class XqaDecode:
    """One engine's XQA state: scratch and semaphores (the kernel resets those it used)."""

    def __init__(
        self, device: torch.device, num_kv_heads: int, page_size: int, pages_per_seq: int, pdl: bool = False
    ) -> None:
        from flashinfer.xqa import xqa

        from common.engine.gpu.xqa_pages import dense_pages  # Triton: imported only where XQA runs

        self.xqa = xqa
        self.dense_pages = dense_pages
        self.pdl = pdl  # a programmatic dependent launch (common/engine/gpu/pdl.py)
        self.num_kv_heads = num_kv_heads
        self.page_size = page_size
        self.scratch = torch.zeros(SCRATCH_BYTES, dtype=torch.uint8, device=device)
        self.semaphores = torch.zeros(SEMAPHORE_BYTES, dtype=torch.uint8, device=device)
        self.pages_per_seq = pages_per_seq

    def pages(self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, width: int = 0) -> XqaPages:
        """XQA's view of flashinfer's CSR description; `width` pages a row where known (eager), else the table's."""
        return XqaPages(*self.dense_pages(indptr, indices, last, width or self.pages_per_seq, self.page_size))

    def probe(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
        """One call on page 0 builds the kernel at start, not inside a graph capture (a JIT compile may fail)."""
        one = torch.zeros(2, dtype=torch.int32, device=self.scratch.device)
        one[1] = 1
        q = torch.zeros(1, num_heads, k_cache.shape[-1], dtype=dtype, device=k_cache.device)
        self.attend(q, k_cache, v_cache, 1.0, 1.0, self.pages(one, one[:1] * 0, one[1:], 1))

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: float,
        v_scale: float,
        pages: XqaPages,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        self.xqa(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            pages.table,
            pages.lens,
            out.unsqueeze(1),
            self.scratch,
            self.semaphores,
            self.num_kv_heads,
            self.page_size,
            q_scale=k_scale / v_scale,
            kv_scale=v_scale,
            enable_pdl=self.pdl,
        )
        return out
