"""The prefix-index lookup on the router's event loop (redis.asyncio), same answers as
``common.prefix.index.PrefixIndexReader.match``.

The shared reader is blocking (redis-py), so the router had to hop to a thread for every long prompt;
the hop (queue put, thread wake-up, loop wake-up) cost more than the Redis round trip itself. This
reader runs the same server-side script (one EVALSHA: each candidate pod's leading matched blocks,
heartbeat-checked) without leaving the loop.

While Redis is down it answers None at once for a backoff period (requests are not each delayed by a
connect timeout), then tries again by itself; the locator logs the outage once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from common.prefix.index import MATCH_LUA, IndexKeys, hashes_hex

__all__ = ["AsyncPrefixReader"]


class AsyncPrefixReader:
    def __init__(
        self, redis_url: str, model_id: str, socket_timeout_s: float = 0.2, max_backoff_s: float = 2.0
    ) -> None:
        self.model_id = model_id
        self.max_backoff_s = max_backoff_s
        self._keys = IndexKeys(model_id)
        # No client-side retries and short timeouts: a request must not wait on Redis (see index.py).
        self._r = aredis.Redis.from_url(
            redis_url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._match = self._r.register_script(MATCH_LUA)
        self._retry_at = 0.0
        self._backoff = 0.0

    async def amatch(self, block_hashes: Sequence[int], pods: Sequence[str]) -> dict[str, int] | None:
        """For each pod, the number of leading blocks of ``block_hashes`` it holds; None if Redis is
        unavailable."""
        if not pods:
            return {}
        if not block_hashes:
            return dict.fromkeys(pods, 0)
        if self._retry_at and time.monotonic() < self._retry_at:
            return None
        try:
            counts = await self._match(args=[self._keys.prefix, hashes_hex(block_hashes), *pods])
        except (RedisError, OSError, TimeoutError):
            self._backoff = min(self.max_backoff_s, max(0.25, self._backoff * 2))
            self._retry_at = time.monotonic() + self._backoff
            return None
        self._retry_at = 0.0
        self._backoff = 0.0
        out: dict[str, int] = {}
        for pod, n in zip(pods, counts, strict=True):
            out[pod] = max(out.get(pod, 0), int(n))
        return out

    async def aclose(self) -> None:
        await self._r.aclose()
