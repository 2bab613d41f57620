"""Host-to-device staging: a step's small host tensors written into one pinned buffer and sent by one
non-blocking copy (each small copy costs a launch and a driver staging copy). The overlap loop plans step N+1
while N is queued, so each `HostToDevice` rotates `slots` buffers and waits on a buffer's copy event before
writing it again; device views are fresh tensors, valid as long as they are held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

_ALIGN = 16  # bytes: every part starts aligned for any dtype's view
_NP_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}
_SIZES = {torch.int64: 8, torch.int32: 4, torch.float32: 4, torch.bool: 1}


@dataclass(eq=False)
class _Slot:
    host: torch.Tensor  # uint8, pinned on CUDA
    array: np.ndarray  # the same bytes, for writes from Python lists
    copied: torch.cuda.Event | None = None  # recorded after the copy that read `host`


def _new_slot(nbytes: int, pinned: bool) -> _Slot:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    return _Slot(host, host.numpy())


@dataclass(eq=False)
class _Part:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(eq=False)
class Stage:
    owner: HostToDevice
    slot: _Slot
    used: int = 0
    parts: list[_Part] = field(default_factory=list)

    def _place(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * _SIZES[dtype]
        off = -(-self.used // _ALIGN) * _ALIGN
        if off + nbytes > self.slot.host.numel():
            self._grow(off + nbytes)
        self.used = off + nbytes
        self.parts.append(_Part(off, nbytes, dtype, shape))
        return off, nbytes

    def _grow(self, need: int) -> None:
        # The slot's last copy has completed (waited on in `stage()`), so the old buffer can go.
        bigger = _new_slot(max(need, 2 * self.slot.host.numel()), self.owner.pinned)
        bigger.array[: self.used] = self.slot.array[: self.used]
        self.owner.replace_slot(self.slot, bigger)
        self.slot = bigger

    def put(
        self, values: Sequence[int] | Sequence[float] | Sequence[bool] | np.ndarray | torch.Tensor, dtype: torch.dtype
    ) -> int:
        """Stages a 1-D part; returns its index in `send()`'s list."""
        if isinstance(values, torch.Tensor):
            values = values.numpy()
        n = len(values)
        off, nbytes = self._place((n,), dtype)
        if n:
            self.slot.array[off : off + nbytes].view(_NP_DTYPES[dtype])[:] = values
        return len(self.parts) - 1

    def reserve(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """A part filled in place: (its index, a host view); fill it before the next put (a growing buffer moves)."""
        off, nbytes = self._place(shape, dtype)
        view = self.slot.host[off : off + nbytes].view(dtype).view(shape)
        return len(self.parts) - 1, view

    def send(self) -> list[torch.Tensor]:
        """One non-blocking copy of everything staged; the device tensors in put order."""
        if not self.parts:
            return []
        owner = self.owner
        dev = self.slot.host[: self.used].to(owner.device, non_blocking=True, copy=True)
        owner.copies += 1
        if owner.device.type == "cuda":
            if self.slot.copied is None:
                self.slot.copied = torch.cuda.Event()
            self.slot.copied.record()
        return [dev[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.parts]


class HostToDevice:
    """Stages and sends host tensors to `device`; `copies` counts the sends."""

    def __init__(self, device: torch.device, slots: int = 2, capacity: int = 1 << 16) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._slots = [_new_slot(capacity, self.pinned) for _ in range(slots)]
        self._next = 0
        self.copies = 0

    def stage(self) -> Stage:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.copied is not None:
            slot.copied.synchronize()  # the copy that last read this buffer (two stages back) has run
        return Stage(self, slot)

    def replace_slot(self, old: _Slot, new: _Slot) -> None:
        self._slots[self._slots.index(old)] = new
