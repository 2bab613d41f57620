"""Where a pool's pages live in memory, and the NIXL descriptor rows for moving page runs. The pool is one
page-major tensor, so a run of consecutive pages is one block: the peer needs only a few numbers (`PoolInfo`),
never NIXL's pickled descriptor lists. All tensor arithmetic, no Python loop over pages.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass

import numpy as np
import torch

from common.kv.pool import KVPool

POOL_INFO_VERSION = 3  # 3: one entry per tensor-parallel rank, with the KV heads it holds


@dataclass(frozen=True)
class PoolInfo:
    """What a peer needs to compute addresses inside this pool (JSON on the wire, never pickle)."""

    agent_name: str
    instance_id: str
    mem_type: str  # "DRAM" or "VRAM", as NIXL names the segment
    device_id: int  # CUDA ordinal; 0 for DRAM (NIXL's convention)
    base_addr: int
    total_bytes: int
    num_layers: int
    num_pages: int
    page_stride: int  # bytes of one page across all layers, K and V
    kv_head_start: int  # the model's KV heads this rank's pool holds: [kv_head_start, kv_head_end)
    kv_head_end: int
    rank: int = 0
    # Set when this rank runs its own NIXL agent (GPU tensor parallelism: only its process can register its memory).
    agent_metadata_b64: str = ""
    version: int = POOL_INFO_VERSION

    @property
    def kv_heads(self) -> int:
        return self.kv_head_end - self.kv_head_start

    @classmethod
    def from_pool(
        cls, pool: KVPool, agent_name: str, instance_id: str, kv_heads: tuple[int, int] | None = None, rank: int = 0
    ) -> PoolInfo:
        kv = pool.kv
        if not kv.is_contiguous():
            # Addresses below assume the canonical strides; a view would send pages to the wrong place.
            raise ValueError("KV pool tensor must be contiguous to be registered for transfer")
        elt = kv.element_size()
        is_cuda = kv.device.type == "cuda"
        return cls(
            agent_name=agent_name,
            instance_id=instance_id,
            mem_type="VRAM" if is_cuda else "DRAM",
            device_id=(kv.device.index or 0) if is_cuda else 0,
            base_addr=kv.data_ptr(),
            total_bytes=kv.numel() * elt,
            num_layers=kv.shape[1],
            num_pages=kv.shape[0],
            page_stride=pool.page_stride_bytes,
            kv_head_start=kv_heads[0] if kv_heads else 0,
            kv_head_end=kv_heads[1] if kv_heads else pool.layout.num_kv_heads,
            rank=rank,
        )

    @classmethod
    def from_dict(cls, raw: object) -> PoolInfo:
        if not isinstance(raw, dict) or raw.get("version") != POOL_INFO_VERSION:
            raise ValueError(f"unsupported pool info (version {raw.get('version') if isinstance(raw, dict) else '?'})")
        info = cls(**raw)  # unknown or missing keys raise TypeError: refuse rather than guess
        info.validate()
        return info

    def validate(self) -> None:
        """Refuses geometry that would let computed addresses leave the registered region."""
        if min(self.num_layers, self.num_pages, self.page_stride) <= 0:
            raise ValueError("pool info has non-positive sizes")
        if self.page_stride * self.num_pages > self.total_bytes:
            raise ValueError("pool info describes more bytes than the registered region")
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"unknown mem_type {self.mem_type!r}")
        if not 0 <= self.kv_head_start < self.kv_head_end:
            raise ValueError("pool info has an empty or negative KV head range")


def pool_infos_to_b64(infos: list[PoolInfo]) -> str:
    return base64.b64encode(json.dumps([asdict(i) for i in infos], sort_keys=True).encode()).decode("ascii")


def pool_infos_from_b64(text: str) -> list[PoolInfo]:
    raw = json.loads(base64.b64decode(text.encode("ascii"), validate=True))
    if not isinstance(raw, list) or not raw:
        raise ValueError("pool info must be a non-empty list (one entry per rank)")
    infos = [PoolInfo.from_dict(r) for r in raw]
    if [i.rank for i in infos] != list(range(len(infos))):
        raise ValueError("pool info ranks must be 0..N-1 in order")
    if len({(i.num_layers, i.num_pages) for i in infos}) != 1:
        raise ValueError("pool info entries disagree on pool geometry")
    head = infos[0]
    for i in infos:
        own_agent = i.agent_name != head.agent_name
        if own_agent != bool(i.agent_metadata_b64) or (not own_agent and i.instance_id != head.instance_id):
            raise ValueError(f"pool info of rank {i.rank}: a rank with its own agent carries its metadata, others none")
    return infos


@dataclass(frozen=True)
class PageRuns:
    src_start: torch.Tensor  # int64 [R]
    dst_start: torch.Tensor  # int64 [R]
    length: torch.Tensor  # int64 [R], pages per run

    @property
    def count(self) -> int:
        return int(self.length.numel())


def page_runs(src_pages: torch.Tensor, dst_pages: torch.Tensor) -> PageRuns:
    """Coalesces page pairs into runs, vectorized: a break wherever either side does not step by +1."""
    src = torch.as_tensor(src_pages).to("cpu", torch.int64).reshape(-1)
    dst = torch.as_tensor(dst_pages).to("cpu", torch.int64).reshape(-1)
    if src.numel() != dst.numel():
        raise ValueError(f"src has {src.numel()} pages, dst has {dst.numel()}")
    n = src.numel()
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return PageRuns(empty, empty, empty)
    brk = (torch.diff(src) != 1) | (torch.diff(dst) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(brk).reshape(-1) + 1])
    ends = torch.cat([starts[1:], torch.tensor([n], dtype=torch.int64)])
    return PageRuns(src[starts], dst[starts], ends - starts)


def check_pages(pages: torch.Tensor, num_pages: int, side: str) -> None:
    """Two reductions, not a loop: an out-of-range id would address memory outside the page array."""
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise ValueError(f"{side} page ids must lie in [0, {num_pages}); got [{int(pages.min())}, {int(pages.max())}]")


def block_descs(
    base_addr: int, page_stride: int, device_id: int, starts: torch.Tensor, lengths: torch.Tensor
) -> np.ndarray:
    """NIXL `(addr, len, dev)` rows for runs of `page_stride`-byte pages from `base_addr`."""
    addr = base_addr + starts * page_stride
    rows = torch.stack([addr, lengths * page_stride, torch.full_like(addr, device_id)], dim=1)
    return rows.numpy().astype(np.uint64)


def run_descs(info: PoolInfo, starts: torch.Tensor, lengths: torch.Tensor) -> np.ndarray:
    return block_descs(info.base_addr, info.page_stride, info.device_id, starts, lengths)
