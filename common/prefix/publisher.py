"""Publishes one worker pod's cached block hashes to the prefix index (keys and scripts: common/prefix/scripts.py).

The scheduler loop only appends to an in-memory buffer; a daemon thread writes it to Redis, keeps the pod's
heartbeat, resyncs after outages and collects the leftovers of dead pods.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis

from common.prefix.access import RedisAccess
from common.prefix.connection import LOG, REDIS_DOWN, OutageLog, client_options
from common.prefix.scripts import CLEAR_BATCH_LUA, POD_STATUS_LUA, IndexKeys, hash_hex

__all__ = ["PrefixIndexPublisher"]

_CLEAR_BATCH = 2000
_SNAPSHOT_CHUNK = 10000


@dataclass
class _Buffer:
    """Events from the scheduler loop, waiting for the publisher thread; guarded by ``cond``."""

    events: list[tuple[str | None, tuple[int, ...]]] = field(default_factory=list)  # (tier or None, hashes)
    n_hashes: int = 0
    # False while Redis is down: events are dropped (bounded memory) and the resync restores the truth.
    accepting: bool = True
    # Full resync wanted: at startup, after an outage, a lost heartbeat key, or a buffer overflow.
    needs_sync: bool = True
    syncing: bool = False  # a sync claimed needs_sync and has not finished yet
    overflowed: bool = False
    pushed: int = 0  # events accepted so far
    flushed: int = 0  # events written to Redis (or superseded by a resync) so far
    cond: threading.Condition = field(default_factory=lambda: threading.Condition(threading.Lock()))


class PrefixIndexPublisher:
    """Publishes one pod's block hashes for one model; owned by a worker.

    ``stored()`` and ``removed()`` (scheduler loop) only append to a buffer, never touching the network. The
    thread writes it in one pipeline per ``flush_interval_s``, keeps the heartbeat, replaces this pod id's
    earlier entries at start, and collects dead pods' leftovers every ``gc_interval_s``. ``resync`` (and
    ``resync_host`` for ``hblk:`` keys) returns the cache's hashes and must be safe beside the scheduler: events
    buffered after it starts are replayed on top. Without it an outage only clears (under-reporting, never stale).
    """

    def __init__(
        self,
        redis_url: str,
        model_id: str,
        pod_id: str,
        heartbeat_s: float = 3.0,
        ttl_s: float = 10.0,
        flush_interval_s: float = 0.05,
        resync: Callable[[], Iterable[int]] | None = None,
        *,
        resync_host: Callable[[], Iterable[int]] | None = None,
        socket_timeout_s: float = 1.0,
        max_backoff_s: float = 2.0,
        max_buffered_hashes: int = 1_000_000,
        gc_interval_s: float = 30.0,
        access: RedisAccess | None = None,
    ) -> None:
        if ttl_s <= heartbeat_s:
            raise ValueError(f"ttl_s ({ttl_s}) must exceed heartbeat_s ({heartbeat_s})")
        self.model_id = model_id
        self.pod_id = pod_id
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self.flush_interval_s = flush_interval_s
        self.max_backoff_s = max_backoff_s
        self.max_buffered_hashes = max_buffered_hashes
        self.gc_interval_s = gc_interval_s
        self._resync = resync
        self._resync_host = resync_host
        self._tiered = resync_host is not None  # host entries may exist: keep both tiers' keys exact
        access = access or RedisAccess()
        self._keys = IndexKeys(model_id, access.key_prefix)
        self._r = redis.Redis.from_url(redis_url, **client_options(socket_timeout_s), **access.client_kwargs(redis_url))
        self._clear_batch = self._r.register_script(CLEAR_BATCH_LUA)
        self._pod_status = self._r.register_script(POD_STATUS_LUA)
        # Identifies this publisher instance: another value in the heartbeat means a second publisher on this pod id.
        self._token = uuid.uuid4().hex
        self._buf = _Buffer()
        self._outage = OutageLog(f"prefix publisher {pod_id}")
        self._stop = threading.Event()
        self._deregister = True
        self._thread: threading.Thread | None = None
        self._next_heartbeat = 0.0
        self._next_gc = 0.0
        self._warned_duplicate = False

    def stored(self, hashes: Iterable[int], tier: str = "device") -> None:
        """The cache now holds these blocks in `tier` ("device" or "host"); no I/O."""
        if tier not in ("device", "host"):
            raise ValueError(f"unknown tier {tier!r}")
        self._push(tier, hashes)

    def removed(self, hashes: Iterable[int]) -> None:
        """The cache evicted these blocks; no I/O."""
        self._push(None, hashes)

    def _push(self, tier: str | None, hashes: Iterable[int]) -> None:
        items = tuple(hashes)  # copy: the caller may reuse its list
        if not items:
            return
        if tier == "host":
            self._tiered = True
        b = self._buf
        with b.cond:
            if not b.accepting:
                return
            b.events.append((tier, items))
            b.n_hashes += len(items)
            b.pushed += 1
            b.cond.notify_all()  # the thread may be waiting for work (`_wait_for_work`)
            if b.n_hashes > self.max_buffered_hashes:
                # The thread cannot keep up: drop and resync instead of growing (logged by the thread: no I/O here).
                b.events.clear()
                b.n_hashes = 0
                b.needs_sync = True
                b.overflowed = True

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._thread = threading.Thread(target=self._run, name=f"kvferry-prefix-{self.pod_id}", daemon=True)
        self._thread.start()

    def stop(self, deregister: bool = True, timeout_s: float = 5.0) -> None:
        """Stops the thread. ``deregister`` (graceful drain): the heartbeat goes first, so routers stop counting
        this pod at once, then its entries; otherwise they stay until the heartbeat expires and gc takes them."""
        self._deregister = deregister
        self._stop.set()
        with self._buf.cond:
            self._buf.cond.notify_all()  # wakes the thread out of `_wait_for_work`
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                LOG.warning(
                    "prefix publisher %s: thread did not stop within %.1fs",
                    self.pod_id,
                    timeout_s,
                )
        with self._buf.cond:
            self._buf.accepting = False
            self._buf.events.clear()
            self._buf.n_hashes = 0
        self._r.close()

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Blocks until every event pushed before this call is in Redis (tests; a worker advertising before ready)."""
        b = self._buf
        with b.cond:
            target = b.pushed
            return b.cond.wait_for(
                lambda: not (b.needs_sync or b.syncing) and b.flushed >= target,
                timeout_s,
            )

    def _run(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            try:
                self._step()
                self._outage.ok()
                backoff = 0.0
            except REDIS_DOWN as exc:
                self._on_failure(exc)
                backoff = min(self.max_backoff_s, max(0.1, backoff * 2))
            except Exception:  # a bug in resync() or here must not kill the thread
                LOG.exception("prefix publisher %s: unexpected error; will resync", self.pod_id)
                self._on_failure(None)
                backoff = min(self.max_backoff_s, max(0.1, backoff * 2))
            if backoff:
                self._stop.wait(backoff)
            else:
                self._wait_for_work()
        self._shutdown()

    def _wait_for_work(self) -> None:
        """Waits ``flush_interval_s`` (events meanwhile share one pipeline); with nothing buffered, sleeps until
        an event, the next heartbeat or gc, or ``stop``."""
        if self._stop.wait(self.flush_interval_s):
            return
        b = self._buf
        with b.cond:
            due = min(self._next_heartbeat, self._next_gc) - time.monotonic()
            b.cond.wait_for(lambda: bool(b.events) or b.needs_sync or self._stop.is_set(), max(0.0, due))

    def _on_failure(self, exc: BaseException | None) -> None:
        if exc is not None:
            self._outage.failed(exc)
        b = self._buf
        with b.cond:
            # Buffered events may or may not have reached Redis: stop buffering and resync once it answers.
            b.events.clear()
            b.n_hashes = 0
            b.accepting = False
            b.needs_sync = True
            b.syncing = False

    def _step(self) -> None:
        b = self._buf
        with b.cond:
            sync = b.needs_sync
            overflowed, b.overflowed = b.overflowed, False
        if overflowed:
            LOG.warning("prefix publisher %s: event buffer overflowed; resyncing", self.pod_id)
        if sync:
            self._full_sync()
        self._flush()
        now = time.monotonic()
        if now >= self._next_gc:
            self._next_gc = now + self.gc_interval_s
            self._collect_dead_pods()

    def _full_sync(self) -> None:
        b = self._buf
        with b.cond:
            # Buffering resumes before the snapshot: later changes replay on top (idempotent, last event wins).
            b.accepting = True
            # Claimed now, so a request raised meanwhile is not lost when this sync finishes.
            b.needs_sync = False
            b.syncing = True
        # Heartbeat first: another pod's collector checks it atomically per batch, so it cannot delete what follows.
        self._heartbeat(time.monotonic())
        self._r.sadd(self._keys.pods, self.pod_id)
        self._clear_own(gc=False)
        blocks_key = self._keys.pod_blocks(self.pod_id)
        prefix = self._keys.prefix
        synced = 0
        for kind, source in (("blk", self._resync), ("hblk", self._resync_host)):
            snapshot = [hash_hex(h) for h in (source() if source is not None else ())]
            synced += len(snapshot)
            for start in range(0, len(snapshot), _SNAPSHOT_CHUNK):
                chunk = snapshot[start : start + _SNAPSHOT_CHUNK]
                pipe = self._r.pipeline(transaction=False)
                for hx in chunk:
                    pipe.sadd(f"{prefix}{kind}:{hx}", self.pod_id)
                pipe.sadd(blocks_key, *chunk)
                pipe.execute()
        with b.cond:
            b.syncing = False
        if synced or self._resync is not None:
            LOG.info("prefix publisher %s: synced %d blocks", self.pod_id, synced)

    def _flush(self) -> None:
        b = self._buf
        with b.cond:
            events, b.events = b.events, []
            b.n_hashes = 0
            upto = b.pushed
        now = time.monotonic()
        hb_due = now >= self._next_heartbeat
        if events or hb_due:
            # Last event per hash wins; a block stored and evicted within one interval costs nothing.
            net: dict[int, str | None] = {}
            for tier, hashes in events:
                for h in hashes:
                    net[h] = tier
            on_device = [hash_hex(h) for h, tier in net.items() if tier == "device"]
            on_host = [hash_hex(h) for h, tier in net.items() if tier == "host"]
            adds = on_device + on_host
            dels = [hash_hex(h) for h, tier in net.items() if tier is None]
            tiered = self._tiered
            prefix = self._keys.prefix
            blocks_key = self._keys.pod_blocks(self.pod_id)
            pipe = self._r.pipeline(transaction=False)
            if hb_due:
                # SET ... GET: None means the key vanished (Redis restarted, or we stalled past the TTL and were
                # collected), so our entries are incomplete: resync.
                pipe.set(
                    self._keys.heartbeat(self.pod_id),
                    self._token,
                    px=int(self.ttl_s * 1000),
                    get=True,
                )
            for hx in on_device:
                pipe.sadd(f"{prefix}blk:{hx}", self.pod_id)
                if tiered:
                    pipe.srem(f"{prefix}hblk:{hx}", self.pod_id)
            for hx in on_host:
                pipe.sadd(f"{prefix}hblk:{hx}", self.pod_id)
                pipe.srem(f"{prefix}blk:{hx}", self.pod_id)
            for hx in dels:
                pipe.srem(f"{prefix}blk:{hx}", self.pod_id)
                if tiered:
                    pipe.srem(f"{prefix}hblk:{hx}", self.pod_id)
            if adds:
                pipe.sadd(blocks_key, *adds)
            if dels:
                pipe.srem(blocks_key, *dels)
            results = pipe.execute()
            if hb_due:
                self._next_heartbeat = now + self.heartbeat_s
                self._check_heartbeat(results[0])
        with b.cond:
            b.flushed = max(b.flushed, upto)
            b.cond.notify_all()

    def _heartbeat(self, now: float) -> None:
        self._r.set(self._keys.heartbeat(self.pod_id), self._token, px=int(self.ttl_s * 1000))
        self._next_heartbeat = now + self.heartbeat_s

    def _check_heartbeat(self, previous: bytes | None) -> None:
        if previous is None:
            LOG.warning(
                "prefix publisher %s: heartbeat key had vanished; resyncing",
                self.pod_id,
            )
            with self._buf.cond:
                self._buf.needs_sync = True
        elif previous != self._token.encode() and not self._warned_duplicate:
            self._warned_duplicate = True
            LOG.warning(
                "prefix publisher %s: another publisher uses the same pod id",
                self.pod_id,
            )

    def _clear_own(self, gc: bool, pod_id: str | None = None) -> bool:
        """Removes a pod's entries in batches; False if a gc run found the pod alive again."""
        pod = self.pod_id if pod_id is None else pod_id
        keys = [self._keys.pod_blocks(pod), self._keys.heartbeat(pod), self._keys.pods]
        args = [self._keys.prefix, pod, _CLEAR_BATCH, "1" if gc else "0"]
        while True:
            left = int(self._clear_batch(keys=keys, args=args))
            if left < 0:
                return False
            if left == 0:
                return True

    def _collect_dead_pods(self) -> None:
        _live, dead = self._pod_status(keys=[self._keys.pods], args=[self._keys.prefix])
        for raw in dead:
            pod = raw.decode()
            if pod != self.pod_id and self._clear_own(gc=True, pod_id=pod):
                LOG.info(
                    "prefix publisher %s: removed leftovers of dead pod %s",
                    self.pod_id,
                    pod,
                )

    def _shutdown(self) -> None:
        try:
            if self._deregister:
                # Heartbeat first: routers count this pod as 0 at once, even while entries are removed.
                self._r.delete(self._keys.heartbeat(self.pod_id))
                self._clear_own(gc=False)
                self._r.srem(self._keys.pods, self.pod_id)
            elif not self._buf.needs_sync:
                self._flush()
        except REDIS_DOWN as exc:
            LOG.warning("prefix publisher %s: could not deregister (%s)", self.pod_id, exc)
