"""One simulated worker's prefix cache: the prompt blocks it keeps, least recently used evicted first.

Kept per touch, not per block: a prompt's blocks are stamped with the touch that used them last (one dict update
in C for the whole prompt) and each touch's blocks are queued in the prompt's order. The oldest touch's blocks,
less those a later touch stamped again, are then exactly the least recently used ones in order, so eviction walks
them from the head of the queue: the same blocks leave in the same order as from a per-block LRU list, while a
touch costs no Python step per block.
"""

from __future__ import annotations

from collections import deque

__all__ = ["PrefixCache"]


class PrefixCache:
    __slots__ = ("_evicted", "_stamp", "_touch", "_touches")

    def __init__(self) -> None:
        self._stamp: dict[int, int] = {}  # cached block -> the touch that used it last
        self._touches: deque[tuple[int, tuple[int, ...]]] = deque()  # (touch, its blocks), oldest first
        self._touch = 0
        self._evicted = 0  # blocks of the oldest touch already walked by eviction

    def __len__(self) -> int:
        return len(self._stamp)

    def leading(self, blocks: tuple[int, ...]) -> int:
        """How many of `blocks`' leading blocks it holds."""
        stamp, k = self._stamp, 0
        for b in blocks:
            if b not in stamp:
                break
            k += 1
        return k

    def touch(self, blocks: tuple[int, ...], room: int) -> None:
        """`blocks` (distinct, in the prompt's order) used now: cached, the most recent; the least recently used
        leave until it holds at most `room` blocks."""
        self._touch += 1
        stamp = self._stamp
        stamp.update(dict.fromkeys(blocks, self._touch))
        touches = self._touches
        touches.append((self._touch, blocks))
        while len(stamp) > room:
            n, oldest = touches[0]
            i = self._evicted
            while i < len(oldest) and len(stamp) > room:
                b = oldest[i]
                i += 1
                if stamp.get(b) == n:
                    del stamp[b]
            if i < len(oldest):
                self._evicted = i
            else:
                touches.popleft()
                self._evicted = 0
        if len(touches) > 2 * room + 16:
            self._compact()  # at most `room` touches hold a block under their own stamp: the rest are spent

    def _compact(self) -> None:
        """Drops the touches none of whose blocks it still holds under their stamp (each used again since, or
        evicted)."""
        stamp = self._stamp
        first, rest = self._touches[0], list(self._touches)[1:]
        head = [first] if any(stamp.get(b) == first[0] for b in first[1][self._evicted :]) else []
        if not head:
            self._evicted = 0
        self._touches = deque(head + [(n, bs) for n, bs in rest if any(stamp.get(b) == n for b in bs)])
