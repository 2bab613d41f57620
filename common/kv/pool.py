from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV pool; equal layouts are required on both ends of a transfer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of K (or V) for one layer: one contiguous block in the pool."""
        return self.page_size * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.page_bytes // self.page_size


class KVPool:
    """The paged KV cache of one worker.

    Layout `[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`, chosen for two users:
    - attention: `k_cache(l)` / `v_cache(l)` are contiguous `[num_pages, page_size, H, D]` tensors,
      flashinfer's NHD paged layout, and flatten to `[num_pages * page_size, H, D]` token slots;
    - transfer: one page of one layer of K (or V) is one contiguous block, and pages p..p+n are adjacent,
      so a run of consecutive pages is a single NIXL descriptor per (layer, K/V).
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.kv = torch.zeros(
            (layout.num_layers, 2, num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim),
            dtype=layout.dtype,
            device=self.device,
        )

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def k_slots(self, layer: int) -> torch.Tensor:
        """K of one layer as `[num_pages * page_size, H, D]`, indexed by raw token location."""
        return self.kv[layer, 0].view(-1, self.layout.num_kv_heads, self.layout.head_dim)

    def v_slots(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1].view(-1, self.layout.num_kv_heads, self.layout.head_dim)

    def page_checksums(self, pages: torch.Tensor) -> torch.Tensor:
        """Per-page float64 sums over all layers and K/V, for debug checks that pages arrived intact."""
        sel = self.kv[:, :, pages.to(self.device, torch.int64)]
        return sel.to(torch.float64).sum(dim=(0, 1, 3, 4, 5)).cpu()

    @staticmethod
    def pages_for_bytes(layout: KVLayout, memory_bytes: int) -> int:
        return max(1, memory_bytes // (2 * layout.num_layers * layout.page_bytes))
