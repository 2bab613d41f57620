"""Rank 0 -> follower ranks: one step message at a time through a shared-memory file (a gloo broadcast cost two
TCP round trips per step). Followers spin briefly after each message, then poll with short sleeps.

Layout (int64): [0] sequence, [1] length, [2 + r] the last sequence follower r copied, then the message. Rank 0
writes only after every follower copied the previous one, storing message, length, then sequence; readers load
the sequence first: x86 (TSO) sees stores in program order, which the ordering relies on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import torch

HEADER_SLOTS = 16  # sequence, length, acks of up to 14 followers
SPIN_S = 0.005  # after a message, followers spin this long before polling with sleeps
POLL_SLEEP_S = 50e-6


class StepChannel:
    def __init__(self, path: str, num_ranks: int, capacity: int, create: bool) -> None:
        if num_ranks - 1 > HEADER_SLOTS - 2:
            raise ValueError(f"at most {HEADER_SLOTS - 1} ranks")
        self.path = path
        self.capacity = capacity
        numel = HEADER_SLOTS + capacity
        if create:
            with open(path, "wb") as f:
                f.truncate(numel * 8)
        self._tensor = torch.from_file(path, shared=True, size=numel, dtype=torch.int64)
        self.words = self._tensor.numpy()
        self.num_ranks = num_ranks
        self._seen = int(self.words[0]) if not create else 0
        self._last_message_at = time.monotonic()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def send(self, message: np.ndarray, check_alive: Callable[[], None], timeout_s: float | None = None) -> None:
        """Publishes `message` once every follower took the last one (TimeoutError after `timeout_s`)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        n = int(message.size)
        if n > self.capacity:
            raise ValueError(f"step message of {n} words exceeds the channel's {self.capacity}")
        w = self.words
        seq = int(w[0])
        acks = w[2 : 1 + self.num_ranks]
        spins = 0
        while (acks != seq).any():
            spins += 1
            if spins % 1024 == 0:
                check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"a tensor-parallel rank did not take step {seq} within {timeout_s} s")
                time.sleep(POLL_SLEEP_S)
        w[HEADER_SLOTS : HEADER_SLOTS + n] = message
        w[1] = n
        w[0] = seq + 1

    def recv(self, rank: int, idle: Callable[[], None] | None = None) -> torch.Tensor:
        """Waits for the next message and returns a copy; `idle` runs between polls once the spin is over."""
        w = self.words
        while int(w[0]) == self._seen:
            if time.monotonic() - self._last_message_at > SPIN_S:
                if idle is not None:
                    idle()
                time.sleep(POLL_SLEEP_S)
        seq = int(w[0])
        n = int(w[1])
        out = torch.from_numpy(w[HEADER_SLOTS : HEADER_SLOTS + n].copy())
        self._seen = seq
        w[1 + rank] = seq
        self._last_message_at = time.monotonic()
        return out
