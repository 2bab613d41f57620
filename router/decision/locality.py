"""Where a prompt's prefix already is: the Redis prefix index, plus the router's own recent placements (workers
publish a block only after computing it, so a burst sharing a new prefix would all miss). A host-tier block
counts as ``1 - host_hit_cost`` of one (a copy back costs about a tenth of a prefill). Redis down: None, routing
on load alone, resuming by itself.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from common import settings_registry as reg

log = logging.getLogger("kvferry.router")

__all__ = ["HOST_HIT_COST", "PrefixLocator", "RecentPlacements", "saved_blocks"]


class _Reader(Protocol):
    async def match_tiers(
        self, block_hashes: Sequence[int], pods: Sequence[str]
    ) -> dict[str, tuple[int, int]] | None: ...


class RecentPlacements:
    def __init__(self, ttl_s: float = reg.ROUTER_RECENT_ROUTE_TTL_S.default, max_blocks: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, dict[str, float]] = OrderedDict()

    def record(self, pod: str, hashes: Sequence[int], now: float | None = None) -> None:
        if self.ttl_s <= 0 or not hashes:
            return
        expiry = (time.monotonic() if now is None else now) + self.ttl_s
        blocks = self._blocks
        for h in hashes:
            entry = blocks.get(h)
            if entry is None:
                blocks[h] = {pod: expiry}
            else:
                entry[pod] = expiry
                blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def match(self, hashes: Sequence[int], pods: Sequence[str], now: float | None = None) -> dict[str, int]:
        """Leading blocks of ``hashes`` each pod was recently sent (a pod drops out at its first miss)."""
        now = time.monotonic() if now is None else now
        counts = dict.fromkeys(pods, 0)
        active = set(pods)
        for h in hashes:
            entry = self._blocks.get(h)
            if entry is None:
                break
            still = {p for p in active if entry.get(p, 0.0) > now}
            for p in still:
                counts[p] += 1
            active = still
            if not active:
                break
        return counts


HOST_HIT_COST = 0.1


def saved_blocks(device: int, host: int, host_hit_cost: float = HOST_HIT_COST) -> int:
    """Blocks of prefill work a pod saves: host ones discounted and rounded down (never tying a device hit)."""
    return device + int(host * (1.0 - host_hit_cost))


class PrefixLocator:
    def __init__(
        self, reader: _Reader | None, recent: RecentPlacements | None = None, host_hit_cost: float = HOST_HIT_COST
    ) -> None:
        self.reader = reader
        self.recent = recent or RecentPlacements()
        self.host_hit_cost = host_hit_cost
        self.redis_ok = True

    async def lookup(self, hashes: Sequence[int], pods: Sequence[str]) -> dict[str, int] | None:
        """Leading matched blocks per pod (host blocks discounted); None when the index is unavailable."""
        if self.reader is None:
            return None
        if not pods:
            return {}
        found: dict[str, int] | None
        if not hashes:
            found = dict.fromkeys(pods, 0)
        else:  # on the loop (common/prefix/reader.py)
            tiers = await self.reader.match_tiers(hashes, pods)
            found = (
                None
                if tiers is None
                else {pod: saved_blocks(d, h, self.host_hit_cost) for pod, (d, h) in tiers.items()}
            )
        if found is None:
            if self.redis_ok:
                self.redis_ok = False
                log.warning("prefix index unavailable: routing on load alone until Redis answers again")
            return None
        if not self.redis_ok:
            self.redis_ok = True
            log.warning("prefix index reachable again: prefix-aware routing resumed")
        if hashes:
            for pod, n in self.recent.match(hashes, pods).items():
                if n > found.get(pod, 0):
                    found[pod] = n
        return found

    def placed(self, pod: str | None, hashes: Sequence[int]) -> None:
        if pod:
            self.recent.record(pod, hashes)
