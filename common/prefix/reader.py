"""Reads the prefix index on the caller's event loop: how many leading blocks of a prompt each candidate pod
holds, one EVALSHA per lookup. While Redis is down every call answers None at once for a backoff period, then
it retries by itself; the outage is logged when it starts and ends.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.asyncio as aredis

from common.prefix.access import RedisAccess
from common.prefix.connection import REDIS_DOWN, OutageLog, client_options
from common.prefix.scripts import MATCH_LUA, POD_STATUS_LUA, IndexKeys, hashes_hex

__all__ = ["PrefixIndexReader", "TierMatch"]

TierMatch = tuple[int, int]  # (leading blocks in device memory, blocks after them in the host tier)


class PrefixIndexReader:
    def __init__(
        self,
        redis_url: str,
        model_id: str,
        socket_timeout_s: float = 0.2,
        *,
        max_backoff_s: float = 2.0,
        access: RedisAccess | None = None,
    ):
        self.model_id = model_id
        self.max_backoff_s = max_backoff_s
        access = access or RedisAccess()
        self._keys = IndexKeys(model_id, access.key_prefix)
        options = client_options(socket_timeout_s, for_asyncio=True)
        self._r = aredis.Redis.from_url(redis_url, **options, **access.client_kwargs(redis_url))
        # One EVALSHA per call; after a Redis restart redis-py loads the script once and retries.
        self._match = self._r.register_script(MATCH_LUA)
        self._pod_status = self._r.register_script(POD_STATUS_LUA)
        self._outage = OutageLog("prefix reader")
        self._retry_at = 0.0
        self._backoff = 0.0

    async def match(self, block_hashes: Sequence[int], pods: Sequence[str]) -> dict[str, int] | None:
        """Per candidate pod, its leading blocks of ``block_hashes`` in either tier (0: expired heartbeat); None
        if Redis is unavailable."""
        tiers = await self.match_tiers(block_hashes, pods)
        return None if tiers is None else {pod: device + host for pod, (device, host) in tiers.items()}

    async def match_tiers(self, block_hashes: Sequence[int], pods: Sequence[str]) -> dict[str, TierMatch] | None:
        """Per candidate pod, (device blocks, host blocks after them) of the leading blocks; None if unavailable."""
        if not pods:
            return {}
        if not block_hashes:
            return dict.fromkeys(pods, (0, 0))
        args = [self._keys.prefix, hashes_hex(block_hashes), *pods]
        counts = await self._call(lambda: self._match(args=args))
        if counts is None:
            return None
        out: dict[str, TierMatch] = {}
        for i, pod in enumerate(pods):  # a pod listed twice keeps its longer match
            found = (int(counts[2 * i]), int(counts[2 * i + 1]))
            if pod not in out or sum(found) > sum(out[pod]):
                out[pod] = found
        return out

    async def live_pods(self) -> list[str] | None:
        """Pods with a live heartbeat for this model; None if Redis is unavailable."""
        res = await self._call(lambda: self._pod_status(keys=[self._keys.pods], args=[self._keys.prefix]))
        if res is None:
            return None
        return sorted(p.decode() for p in res[0])

    async def aclose(self) -> None:
        await self._r.aclose()

    async def _call(self, fn: Callable[[], Awaitable[Any]]) -> Any | None:
        if self._retry_at and time.monotonic() < self._retry_at:
            return None
        try:
            res = await fn()
        except REDIS_DOWN as exc:
            self._outage.failed(exc)
            self._backoff = min(self.max_backoff_s, max(0.25, self._backoff * 2))
            self._retry_at = time.monotonic() + self._backoff
            return None
        self._retry_at = 0.0
        self._backoff = 0.0
        self._outage.ok()
        return res
