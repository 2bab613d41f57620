"""The dtype a model runs in, from its setting: one answer for the runner and the tensor-parallel ranks."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on the CPU (no fast 16-bit kernels there) and bfloat16 on accelerators."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[name]
