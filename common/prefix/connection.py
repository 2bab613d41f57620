"""How the prefix index talks to Redis: client options, what counts as "Redis is down", and an outage logged
once. Every failure degrades to "know nothing" instead of raising into the caller (the index is a hint)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

LOG = logging.getLogger("kvferry.prefix")

# Failures that mean "Redis is not usable right now". OSError covers socket errors redis-py lets through
# (and timeouts: TimeoutError is an OSError).
REDIS_DOWN = (RedisError, OSError)


def client_options(timeout_s: float, for_asyncio: bool = False) -> dict[str, Any]:
    """Options for `redis.Redis.from_url` (or `redis.asyncio.Redis.from_url`). redis-py's default client
    retries 10 times with exponential backoff (seconds in total) on a connection error. A router must not
    stall a request on that, and the publisher has its own backoff and resync, so: no client-side retries,
    short timeouts, and the caller decides what a failure means."""
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": (AsyncRetry if for_asyncio else Retry)(NoBackoff(), 0),
        "retry_on_timeout": False,
        "health_check_interval": 0,
    }


@dataclass
class OutageLog:
    """Log a Redis outage once when it starts and once when it ends, not once per failed call."""

    what: str
    down: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def failed(self, exc: BaseException) -> None:
        with self.lock:
            if self.down:
                return
            self.down = True
        LOG.warning("%s: Redis unavailable (%s: %s); prefix routing degraded", self.what, type(exc).__name__, exc)

    def ok(self) -> None:
        if not self.down:  # fast path without the lock: the common case on every call
            return
        with self.lock:
            if not self.down:
                return
            self.down = False
        LOG.info("%s: Redis reachable again; prefix index recovered", self.what)
