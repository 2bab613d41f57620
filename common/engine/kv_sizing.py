"""How many KV pages a worker's pool gets when no size is configured."""

from __future__ import annotations

import torch

from common.engine.model_config import ModelConfig
from common.kv.pool import KVLayout, KVPool

CPU_DEFAULT_BYTES = 1 << 30
# Kept free on a GPU after the pool: activations of a prefill chunk, the CUDA graphs' memory pool, attention
# and sampling workspaces, NCCL and NIXL buffers. 8% of the card, at least 4 GiB.
GPU_RESERVE_FRACTION = 0.08
GPU_RESERVE_MIN_BYTES = 4 << 30


def model_kv_layout(
    cfg: ModelConfig, page_size: int, dtype: torch.dtype, heads: int | None = None, scales: tuple[float, ...] = ()
) -> KVLayout:
    """The pool layout of `cfg` with `heads` of its KV heads (all when None): K and V per head, or for latent
    attention (MLA) one entry of `kv_lora_rank + qk_rope_head_dim` per token, no V and no static scales."""
    if cfg.mla is not None:
        return KVLayout(cfg.num_layers, 1, cfg.mla.latent_dim, page_size, dtype, kv_parts=1)
    return KVLayout(
        cfg.num_layers, cfg.num_kv_heads if heads is None else heads, cfg.head_dim, page_size, dtype, scales
    )


def kv_pool_pages(layout: KVLayout, kv_memory_gb: float, num_pages: int, device: torch.device) -> int:
    """`num_pages` if set, else `kv_memory_gb` worth of pages, else (0) what the device has room for."""
    if num_pages > 0:
        return num_pages
    if kv_memory_gb > 0:
        return KVPool.pages_for_bytes(layout, int(kv_memory_gb * (1 << 30)))
    if device.type != "cuda":
        return KVPool.pages_for_bytes(layout, CPU_DEFAULT_BYTES)
    free, total = torch.cuda.mem_get_info(device)
    reserve = max(GPU_RESERVE_MIN_BYTES, int(GPU_RESERVE_FRACTION * total))
    if free <= reserve:
        raise RuntimeError(
            f"no device memory left for the KV cache: {free / 2**30:.1f} GiB free after the weights, "
            f"{reserve / 2**30:.1f} GiB reserved; set KVFERRY_KV_MEMORY_GB or use a larger device"
        )
    return KVPool.pages_for_bytes(layout, free - reserve)
