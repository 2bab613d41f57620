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
    """Events from the scheduler loop, waiting for the publisher thread. Guarded by ``cond``."""

    events: list[tuple[str | None, tuple[int, ...]]] = field(default_factory=list)  # (tier or None, hashes)
    n_hashes: int = 0
    # False while Redis is known to be down: events are dropped on arrival (memory stays bounded) and the
    # resync after reconnecting restores the truth.
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

    ``stored()`` and ``removed()`` are called from the scheduler loop: they only append to an in-memory
    buffer under a lock and never touch the network. A daemon thread writes the buffer in one pipeline per
    ``flush_interval_s``, refreshes the heartbeat every ``heartbeat_s`` (TTL ``ttl_s``), and on startup
    replaces whatever this pod id published before (a restarted pod must not leave stale entries).

    ``resync`` returns the cache's current block hashes. It is called on the publisher thread after
    startup and after every outage, so it must be safe to call concurrently with the scheduler (e.g. copy
    under the cache's lock). A snapshot that races with cache updates is fine: every update after the
    publisher resumes buffering is replayed on top of it. Without ``resync`` the pod's entries are cleared
    after an outage and only later events are published (under-reporting, never stale).

    Tiers: ``stored(hashes, "host")`` records blocks a pod keeps in its host-memory tier (``hblk:`` keys),
    ``stored(hashes)`` blocks in device memory; a block moves between the two as the pod's cache moves it.
    ``resync_host`` returns the host tier's hashes for a full sync, as ``resync`` does the device's; a pod
    given one (or that ever stores a host block) also clears a block's host entry when it stores it on the
    device or removes it.

    Every ``gc_interval_s`` the thread also removes the leftovers of pods whose heartbeat expired (crashed
    pods with random Deployment names would otherwise leave their block entries in Redis forever).
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
        # Heartbeat value identifying this publisher instance: seeing another value means a second live
        # publisher uses the same pod id (misconfiguration worth a warning).
        self._token = uuid.uuid4().hex
        self._buf = _Buffer()
        self._outage = OutageLog(f"prefix publisher {pod_id}")
        self._stop = threading.Event()
        self._deregister = True
        self._thread: threading.Thread | None = None
        self._next_heartbeat = 0.0
        self._next_gc = 0.0
        self._warned_duplicate = False

    # ---- called from the scheduler loop -------------------------------------------------------------

    def stored(self, hashes: Iterable[int], tier: str = "device") -> None:
        """The cache now holds these blocks in `tier` ("device" or "host"). O(len(hashes)), no I/O."""
        if tier not in ("device", "host"):
            raise ValueError(f"unknown tier {tier!r}")
        self._push(tier, hashes)

    def removed(self, hashes: Iterable[int]) -> None:
        """The cache evicted these blocks. O(len(hashes)), no I/O."""
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
                # The thread cannot keep up (or is stuck on a slow Redis): drop and resync instead of
                # growing without bound. Logged by the thread, not here (no I/O on the caller's path).
                b.events.clear()
                b.n_hashes = 0
                b.needs_sync = True
                b.overflowed = True

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._thread = threading.Thread(target=self._run, name=f"kvferry-prefix-{self.pod_id}", daemon=True)
        self._thread.start()

    def stop(self, deregister: bool = True, timeout_s: float = 5.0) -> None:
        """Stop the thread. With ``deregister`` (graceful drain) the heartbeat goes first, so routers stop
        counting this pod's prefixes at once, then all its entries; without it the buffer is flushed and
        the entries stay until the heartbeat expires (then they count 0 and are garbage-collected)."""
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
            # Later calls become no-ops instead of growing a buffer nobody drains.
            self._buf.accepting = False
            self._buf.events.clear()
            self._buf.n_hashes = 0
        self._r.close()

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Block until every event pushed before this call is in Redis (after the initial sync). For tests
        and for a worker that wants its cache advertised before reporting ready; never needed otherwise."""
        b = self._buf
        with b.cond:
            target = b.pushed
            return b.cond.wait_for(
                lambda: not (b.needs_sync or b.syncing) and b.flushed >= target,
                timeout_s,
            )

    # ---- publisher thread ---------------------------------------------------------------------------

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
        """Waits ``flush_interval_s`` (events arriving meanwhile go out in one pipeline), then, with nothing
        buffered, blocks until an event, the next heartbeat or gc, or ``stop``: an idle pod's thread sleeps."""
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
            # Anything buffered may or may not have reached Redis; stop buffering (bounded memory) and
            # rebuild this pod's entries from the cache once Redis answers again.
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
        """Replace this pod's entries with the cache's current hashes."""
        b = self._buf
        with b.cond:
            # Resume buffering before taking the snapshot: every change from here on is replayed after the
            # snapshot is written, so a snapshot that races with the scheduler still converges (SADD/SREM
            # replays are idempotent and the last event per hash wins).
            b.accepting = True
            # Claim the request now, so one raised meanwhile (buffer overflow, vanished heartbeat) is
            # not lost when this sync finishes; a failure sets it again.
            b.needs_sync = False
            b.syncing = True
        # Heartbeat first: a collector on another pod checks it atomically per batch, so from here on it
        # cannot delete what we are about to write.
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
        """Write buffered events (and the heartbeat when due) in one pipeline."""
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
                # SET ... GET returns the previous value: None means the key vanished (Redis restarted
                # or was flushed without us seeing a connection error, or we stalled past the TTL and
                # were garbage-collected), so our entries are incomplete: resync.
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
        """Remove a pod's published entries in batches; False if a gc run found the pod alive again."""
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
            # Leftovers stop counting when the heartbeat expires and are collected by the other pods.
            LOG.warning("prefix publisher %s: could not deregister (%s)", self.pod_id, exc)
