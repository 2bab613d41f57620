"""Counts host-to-device copies, where they come from, on the CPU as on a GPU.

On the CPU every `.to("cpu")` is a no-op, so a copy is counted where it would cross to the device under test
(the engine's device object, e.g. `runner.device`: on the CPU only that object counts, not a `.to("cpu")` that
brings a tensor to the host): a `Tensor.to` naming that device called on a host tensor, a `torch.tensor` /
`torch.as_tensor` built on it, a `pin_memory` (a copy to a GPU is about to follow), and, off the CPU, a
`copy_` from a host tensor into a tensor on it. Each is recorded with the first frame of the project's code
that made it.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

_ROOT = str(Path(__file__).resolve().parents[1])


class HostToDeviceCount:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sites: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def _record(self) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(_ROOT) and not path.endswith("h2d_count.py") and "/tests/" not in path:
                self.sites[f"{Path(path).relative_to(_ROOT)}:{frame.f_lineno}"] += 1
                return
            frame = frame.f_back
        self.sites["<outside the project>"] += 1

    def _is_target(self, dev: object) -> bool:
        if self.device.type == "cpu":
            return dev is self.device
        if isinstance(dev, (str, torch.device)):
            d = torch.device(dev)
            return d.type == self.device.type and (d.index is None or self.device.index in (None, d.index))
        return False

    def reset(self) -> None:
        self.sites.clear()


@contextlib.contextmanager
def count_host_to_device(device: torch.device) -> Iterator[HostToDeviceCount]:
    count = HostToDeviceCount(device)
    to, copy_, pin = torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.pin_memory
    tensor, as_tensor = torch.tensor, torch.as_tensor

    def counted_to(self, *args, **kwargs):
        dev = kwargs.get("device", args[0] if args and not isinstance(args[0], (torch.dtype, torch.Tensor)) else None)
        if self.device.type == "cpu" and count._is_target(dev):
            count._record()
        return to(self, *args, **kwargs)

    def counted_copy(self, src, *args, **kwargs):
        if count.device.type != "cpu" and src.device.type == "cpu" and self.device == count.device:
            count._record()
        return copy_(self, src, *args, **kwargs)

    def counted_pin(self, *args, **kwargs):
        count._record()
        return pin(self, *args, **kwargs)

    def counted_tensor(data, *args, **kwargs):
        if count._is_target(kwargs.get("device")):
            count._record()
        return tensor(data, *args, **kwargs)

    def counted_as_tensor(data, *args, **kwargs):
        if count._is_target(kwargs.get("device")) and not (
            isinstance(data, torch.Tensor) and data.device == count.device
        ):
            count._record()
        return as_tensor(data, *args, **kwargs)

    torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.pin_memory = counted_to, counted_copy, counted_pin
    torch.tensor, torch.as_tensor = counted_tensor, counted_as_tensor
    try:
        yield count
    finally:
        torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.pin_memory = to, copy_, pin
        torch.tensor, torch.as_tensor = tensor, as_tensor
