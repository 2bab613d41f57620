"""The dtypes a model runs in, from their settings: one answer for the runner and the tensor-parallel ranks."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on the CPU (no fast 16-bit kernels there) and bfloat16 on accelerators."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[name]


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype: `auto` is the model's, `fp8_e4m3` float8 e4m3 (common/engine/fp8.py)."""
    if name == "auto":
        return model_dtype
    if name == "fp8_e4m3":
        return torch.float8_e4m3fn
    raise ValueError(f"unknown KV dtype {name!r}; use auto or fp8_e4m3")
