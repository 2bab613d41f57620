"""One GPU that several simulated workers time-share (processes on one device, e.g. a prefill and a decode worker
of one pair): weighted processor sharing between the device parts of their steps.

The model: without MPS a GPU runs one process's kernels at a time and switches between the processes that have
work queued. In the fluid limit each step whose device part is in flight gets a share of the device proportional
to its weight, fixed for the step's life: its kind's weight (a pure decode step 1, a step carrying prompt tokens
``WorkerSpec.prefill_share_weight``) times its device time alone to a power (``WorkerSpec.share_length_exponent``,
``WorkerSpec.share_weight``). Exponent 1 is kernel-by-kernel alternation: a kernel once started runs to its end, so
a decode kernel waits behind the prompt kernel in flight and each side keeps the length of its kernels; a step of
one kind runs a fixed number of kernels (the model's layers times a layer's kernels), so its kernels lengthen with
its device time, and the kinds' kernel counts differ by the measured ratio of their shares (bench/gpu_share.py).
Two steps of one kind that start together then end together, when the device has done both. Exponent 0 is time
slices between queues that never empty: one share per kind whatever a step's length (weight 1 for both: equal
shares). bench/fleet_sim/calibrate.py derives the weight from one bench/gpu_share.py run (exponent 1), or both
from runs at two prompt-chunk lengths.

Time slices (``slice_s`` > 0, ``WorkerSpec.share_slice_s``): the GPU's own scheduler, not a fluid. One step runs at a
time, at full speed; the member holding the device keeps it for a slice, then it passes (round) to a member with a
step waiting. A member keeps its slice between its own steps (the engine queues its next step before the last ends)
and gives it up only when it has nothing queued (``release``: its engine went idle, or a loop that waits on each
step ended one). So a decode step that a prompt chunk overlaps is stretched by a whole slice of the chunk's, and the
steps before and after it are not; a newcomer waits for the holder's slice to end. bench/fleet_sim/calibrate.py
takes the slice from bench/gpu_share.py's loops (``fit_slice_s``).

The shares always sum to one (work-conserving): the device is never idle while a step has work, overlapping steps'
device times add, and a step alone runs at full speed. A step's host part (scheduling, sampling, events, on its
process's own CPU) holds no share: meanwhile the others have the whole device. Not modelled: the cost of a context
switch itself, the spread of where a step falls against the other's kernels or slices, and kernels of two
processes running at once (MPS, green contexts).
"""

from __future__ import annotations

import math
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
    # the steps whose device part is in flight: [worker, device seconds it still needs, its weight] (a few: one
    # per member); a step's weight is fixed for its life (its kernels' length), not shrinking with the work left
    left: list[list[Any]] = field(default_factory=list)
    t: float = 0.0  # when `left` was last brought up to date
    # > 0: time slices of this length instead of shares (see `start`); the member holding the device and when its
    # slice ends (the scheduler's timer runs whether or not another context waits)
    slice_s: float = 0.0
    owner: Any = None
    slice_end: float = 0.0

    def start(self, worker: Any, device_s: float, now: float, weight: float) -> float:
        """`worker` starts a step needing `device_s` of the device alone, its share weighing `weight`; returns
        when its device part ends if nothing else starts meanwhile. The steps it now shares the device with end
        later: `moved` hears of each."""
        self._advance(now)
        self.left = [e for e in self.left if e[0] is not worker]
        if device_s <= _DONE_S:
            return now
        if weight <= 0:
            raise ValueError(f"a step's share weight must be positive, got {weight}")
        self.left.append([worker, device_s, weight])
        if self.slice_s > 0 and self.owner is None:
            self.owner, self.slice_end = worker, now + self.slice_s
        mine = 0.0
        for other, end in self._ends():
            if other is worker:
                mine = end
            else:
                self.moved(other, end)
        return mine

    def release(self, worker: Any, now: float) -> None:
        """`worker` has no next step queued (its engine went idle, or a loop that waits on each step ended one):
        with time slices it gives the device up at once to the next member with a step in flight, whose slice
        starts now. Shares: nothing to do (a worker between steps holds none)."""
        if self.slice_s <= 0:
            return
        self._advance(now)  # first: whose slice it is now
        if self.owner is not worker:
            return
        nxt = self._next_owner(self.owner, self.left)
        self.owner, self.slice_end = nxt, now + self.slice_s
        for other, end in self._ends():
            self.moved(other, end)

    def _next_owner(self, owner: Any, left: list[list[Any]]) -> Any:
        """The member after `owner` (in the order they joined, round) with a step in flight; None: none has."""
        waiting = {id(e[0]) for e in left}
        n = len(self.members)
        start = self.members.index(owner) + 1 if owner in self.members else 0
        for i in range(n):
            m = self.members[(start + i) % n]
            if id(m) in waiting:
                return m
        return left[0][0] if left else None

    def _play(self, until: float | None) -> list[tuple[Any, float]]:
        """Time slices: runs the device from `t` to `until` (None: until every step in flight is done, the state
        left as it was) and returns when each step done meanwhile ended. One step runs at a time, at full speed:
        the owner's, or while the owner has none in flight (its host part between steps, the slice still its
        own), the next member's. At its slice's end the device passes to the next member with a step in flight;
        if none has one the owner keeps it for another slice."""
        left = [list(e) for e in self.left] if until is None else self.left
        t, owner, slice_end, tick = self.t, self.owner, self.slice_end, self.slice_s
        ends: list[tuple[Any, float]] = []
        while left:
            run = next((e for e in left if e[0] is owner), None)
            if run is None:
                run = next(e for e in left if e[0] is self._next_owner(owner, left))
            nxt = min(t + run[1], slice_end)
            if until is not None and nxt > until:
                run[1] -= until - t
                t = until
                break
            run[1] -= nxt - t
            t = nxt
            if run[1] <= _DONE_S:
                left.remove(run)
                ends.append((run[0], t))
            if t >= slice_end - _DONE_S:
                if any(e[0] is not owner for e in left):
                    owner = self._next_owner(owner, [e for e in left if e[0] is not owner])
                slice_end = t + tick
        if until is not None:
            if slice_end <= until:  # nothing in flight: the owner's slices went on
                slice_end += math.ceil((until - slice_end) / tick + 1e-9) * tick
            self.t, self.owner, self.slice_end, self.left = until, owner, slice_end, left
        return ends

    def _advance(self, now: float) -> None:
        """Gives the device's time since `t` to the steps in flight by their weights (those done leave)."""
        if self.slice_s > 0:
            self._play(now)
            return
        dt, self.t = now - self.t, now
        left = self.left
        while dt > 0 and left:
            total = sum(e[2] for e in left)
            span = min(dt, min(e[1] * total / e[2] for e in left))  # until the first is done, at most dt
            dt -= span
            for e in left:
                e[1] -= span * e[2] / total
            left = [e for e in left if e[1] > _DONE_S]
        self.left = left

    def _ends(self) -> list[tuple[Any, float]]:
        """When each step in flight ends, nothing else arriving: the device gives them its time by their weights
        until the first is done, then shares among the rest, and so on (time slices: as `_play` runs them)."""
        if self.slice_s > 0:
            return self._play(None)
        rest = [list(e) for e in self.left]
        ends, t = [], self.t
        while rest:
            total = sum(e[2] for e in rest)
            first = min(rest, key=lambda e: e[1] / e[2])
            span = first[1] * total / first[2]
            t += span
            for e in rest:
                e[1] -= span * e[2] / total
            first[1] = 0.0
            ends.extend((e[0], t) for e in rest if e[1] <= _DONE_S)
            rest = [e for e in rest if e[1] > _DONE_S]
        return ends


def place(
    devices: list[SharedDevice], worker: Any, slots: int, moved: Callable[[Any, float], None], slice_s: float = 0.0
) -> SharedDevice:
    """Puts `worker` on the first device with a free slot (a new one if none has): workers fill GPUs in the order
    they come up."""
    for d in devices:
        if len(d.members) < d.slots:
            break
    else:
        d = SharedDevice(slots, moved, slice_s=slice_s)
        devices.append(d)
    d.members.append(worker)
    return d
