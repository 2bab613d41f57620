"""One simulated worker's prefix cache: the prompt blocks it keeps, least recently used evicted first.

Kept per touch, not per block: the cache maps each block to the touch that used it last (a plain store, where a
per-block LRU list moves or links a node) and queues each touch's blocks in the prompt's order. The oldest touch's
blocks, less those a later touch stamped again, are then exactly the least recently used ones in order, so eviction
walks them from the head of the queue: the same blocks leave in the same order as from a per-block LRU list, in half
the memory of an OrderedDict (a large fleet's caches outgrow the CPU's caches). Being a dict, ``block in cache`` is
the lookup the prefix matches make.
"""

from __future__ import annotations

from collections import deque

__all__ = ["PrefixCache"]


class PrefixCache(dict[int, int]):
    """Cached block -> the touch that used it last."""

    __slots__ = ("_evicted", "_touch", "_touches")

    def __init__(self) -> None:
        super().__init__()
        self._touches: deque[tuple[int, tuple[int, ...]]] = deque()  # (touch, its blocks), oldest first
        self._touch = 0
        self._evicted = 0  # blocks of the oldest touch already walked by eviction

    def touch(self, blocks: tuple[int, ...], room: int) -> None:
        """`blocks` (distinct, in the prompt's order) used now: cached, the most recent; the least recently used
        leave until it holds at most `room` blocks."""
        self._touch = touch = self._touch + 1
        for b in blocks:
            self[b] = touch
        touches = self._touches
        touches.append((touch, blocks))
        excess = len(self) - room
        while excess > 0:
            n, oldest = touches[0]
            i, end = self._evicted, len(oldest)
            while i < end and excess > 0:
                b = oldest[i]
                i += 1
                # a block of a touch not yet walked is cached (it leaves only when the walk reaches the touch
                # that stamped it last, never an earlier one): its stamp tells whether it was used again since
                if self[b] is n:
                    del self[b]
                    excess -= 1
            if i < end:
                self._evicted = i
            else:
                touches.popleft()
                self._evicted = 0
        if len(touches) > 2 * room + 16:
            self._compact()  # at most `room` touches hold a block under their own stamp: the rest are spent

    def _compact(self) -> None:
        """Drops the touches none of whose blocks it still holds under their stamp (each used again since, or
        evicted)."""
        first, rest = self._touches[0], list(self._touches)[1:]
        head = [first] if any(self.get(b) == first[0] for b in first[1][self._evicted :]) else []
        if not head:
            self._evicted = 0
        self._touches = deque(head + [(n, bs) for n, bs in rest if any(self.get(b) == n for b in bs)])
