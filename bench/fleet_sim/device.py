"""One GPU that several simulated workers time-share (processes on one device, e.g. a prefill and a decode worker
of one pair): processor sharing between the device parts of their steps.

The model: without MPS a GPU runs one process's kernels at a time and time-slices between the processes that have
work queued, in slices much shorter than a prompt step. In the fluid limit of that round robin, each of the n
steps whose device part is in flight gets 1/n of the device: overlapping steps' device times add (the device is
never idle while one has work, and has done both when both are done), and a step alone runs at full speed. A
step's host part (scheduling, sampling, events, on its process's own CPU) holds no share: meanwhile the others
have the whole device. Not modelled: the cost of a context switch itself, and kernels of two processes running
at once (MPS, green contexts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SharedDevice", "place"]

_DONE_S = 1e-12  # device work left below this is done (float residue of the shares)


@dataclass(eq=False)
class SharedDevice:
    slots: int  # workers it holds
    # called with (worker, new end of its step's device part) when another step's arrival delays it
    moved: Callable[[Any, float], None]
    members: list[Any] = field(default_factory=list)
    # the steps whose device part is in flight: [worker, device seconds it still needs] (a few: one per member)
    left: list[list[Any]] = field(default_factory=list)
    t: float = 0.0  # when `left` was last brought up to date

    def start(self, worker: Any, device_s: float, now: float) -> float:
        """`worker` starts a step needing `device_s` of the device alone; returns when its device part ends if
        nothing else starts meanwhile. The steps it now shares the device with end later: `moved` hears of each."""
        self._advance(now)
        self.left = [e for e in self.left if e[0] is not worker]
        self.left.append([worker, device_s])
        mine = 0.0
        for other, end in self._ends():
            if other is worker:
                mine = end
            else:
                self.moved(other, end)
        return mine

    def _advance(self, now: float) -> None:
        """Gives the device's time since `t` to the steps in flight in equal shares (those done leave)."""
        dt, self.t = now - self.t, now
        left = self.left
        while dt > 0 and left:
            share = min(min(e[1] for e in left), dt / len(left))
            dt -= share * len(left)
            for e in left:
                e[1] -= share
            left = [e for e in left if e[1] > _DONE_S]
        self.left = left

    def _ends(self) -> list[tuple[Any, float]]:
        """When each step in flight ends, nothing else arriving: in order of work left, the i-th (of n) ends when
        the device has given the first i their work and the n - i others as much each."""
        order = sorted(self.left, key=lambda e: e[1])
        ends, t, prev, n = [], self.t, 0.0, len(order)
        for i, (w, work) in enumerate(order):
            t += (work - prev) * (n - i)
            prev = work
            ends.append((w, t))
        return ends


def place(devices: list[SharedDevice], worker: Any, slots: int, moved: Callable[[Any, float], None]) -> SharedDevice:
    """Puts `worker` on the first device with a free slot (a new one if none has): workers fill GPUs in the order
    they come up."""
    for d in devices:
        if len(d.members) < d.slots:
            break
    else:
        d = SharedDevice(slots, moved)
        devices.append(d)
    d.members.append(worker)
    return d
