from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV pool; both ends of a transfer need equal layouts."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    # FP8 pools: the static scales, K then V per layer (empty: 1.0); both ends of a transfer hold the same ones.
    kv_scales: tuple[float, ...] = ()
    # Entries per token and layer: 2 (K and V), or 1 for latent attention (one shared [latent | roped key] row).
    kv_parts: int = 2

    def kv_scale(self, layer: int, kv: int) -> float:
        return self.kv_scales[2 * layer + kv] if self.kv_scales else 1.0

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of K (or V, or the latent) for one layer: one contiguous block."""
        return self.page_size * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.kv_parts * self.num_layers * self.page_bytes // self.page_size

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.kv_parts, self.page_size, self.num_kv_heads, self.head_dim)


def checksums_match(mine: list[float], theirs: list[float], abs_tol: float = 1e-6) -> bool:
    """Whether two ends' `page_checksums` agree (a different tensor-parallel split only reorders the sums)."""
    return len(mine) == len(theirs) and all(
        math.isclose(a, b, rel_tol=1e-9, abs_tol=abs_tol) for a, b in zip(mine, theirs, strict=True)
    )


class KVPool:
    """The paged KV cache of one worker, page-major: `[num_pages, num_layers, kv_parts, page_size, heads,
    head_dim]`, so a run of consecutive pages is one NIXL descriptor (posting costs per descriptor), and
    `k_cache(l)` / `v_cache(l)` are page-strided views flashinfer's NHD kernels read as they are."""

    def __init__(
        self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu", kv: torch.Tensor | None = None
    ) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        shape = (num_pages, *layout.page_shape)
        if kv is None:
            kv = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        elif tuple(kv.shape) != shape or kv.dtype != layout.dtype or not kv.is_contiguous():
            raise ValueError(f"pool memory {tuple(kv.shape)} {kv.dtype} does not match the layout {shape}")
        self.kv = kv
        # Every [H, D] row; row of (page p, layer l, K/V c, offset o) = ((p*L + l)*parts + c)*ps + o.
        self.rows = self.kv.view(-1, layout.num_kv_heads, layout.head_dim)
        self._rows_per_page = layout.num_layers * layout.kv_parts * layout.page_size

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.kv[:, layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        if self.layout.kv_parts < 2:
            raise ValueError("a latent (MLA) pool has no separate V: values are read from each entry's latent")
        return self.kv[:, layer, 1]

    def token_rows(self, locs: torch.Tensor) -> torch.Tensor:
        """Row in `rows` of layer 0's K for each raw token location; add `layer_offset` for other layers."""
        ps = self.layout.page_size
        return torch.div(locs, ps, rounding_mode="floor") * self._rows_per_page + locs % ps

    def layer_offset(self, layer: int, kv: int) -> int:
        return (self.layout.kv_parts * layer + kv) * self.layout.page_size

    def page_checksums(self, pages: torch.Tensor) -> torch.Tensor:
        """Per-page float64 sums over all layers and K/V (debug checks that pages arrived intact)."""
        sel = self.kv[pages.to(self.device, torch.int64)]
        return sel.to(torch.float64).sum(dim=(1, 2, 3, 4, 5)).cpu()

    @property
    def page_stride_bytes(self) -> int:
        return self.kv.stride(0) * self.kv.element_size()

    @classmethod
    def in_shared_file(cls, layout: KVLayout, num_pages: int, path: str, create: bool) -> KVPool:
        """A CPU pool in a shared-memory file, so another process (a tensor-parallel rank 0) can map its pages."""
        shape = (num_pages, *layout.page_shape)
        numel = math.prod(shape)
        if create:
            with open(path, "wb") as f:
                f.truncate(numel * torch.empty((), dtype=layout.dtype).element_size())  # zero-filled, lazily
        kv = torch.from_file(path, shared=True, size=numel, dtype=layout.dtype).view(shape)
        return cls(layout, num_pages, "cpu", kv)

    @staticmethod
    def pages_for_bytes(layout: KVLayout, memory_bytes: int) -> int:
        return max(1, memory_bytes // (layout.bytes_per_token * layout.page_size))
