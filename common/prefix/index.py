"""The fleet-wide prefix index in Redis: which worker pod holds which chained block hash.

Workers publish (``PrefixIndexPublisher``) the block hashes their radix cache gains and loses; the router
reads (``PrefixIndexReader``) how many leading blocks of a prompt each candidate pod holds and sends the
request where the most prefix already is. The index is a routing hint, never a correctness input: a stale
entry only costs a cache miss on the chosen pod, and a missing Redis only means routing on load alone.
That is why every failure path here degrades to "know nothing" instead of raising into the caller.

Keys (``{model}`` is the model id, ``{hash}`` the 16-digit lowercase hex of a 64-bit block hash):

- ``kvf:{model}:blk:{hash}``: SET of pod ids holding that block.
- ``kvf:{model}:pod:{pod}:blocks``: SET of the hashes (hex) this pod published, so the pod's entries can
  be removed without scanning the keyspace (restart, graceful drain, garbage collection).
- ``kvf:{model}:hb:{pod}``: heartbeat STRING with a TTL; a pod whose heartbeat expired counts as holding
  nothing, whatever its block entries say (it crashed, or lost Redis and its entries are stale).
- ``kvf:{model}:pods``: SET of pod ids that have published, so live pods can be listed and a dead pod's
  leftover entries garbage-collected without SCAN.

Requires Redis >= 6.2 (SMISMEMBER, SET ... GET, SPOP with count).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

__all__ = [
    "IndexKeys",
    "PrefixIndexPublisher",
    "PrefixIndexReader",
    "hash_hex",
    "hashes_hex",
]

LOG = logging.getLogger("kvferry.prefix")

# Failures that mean "Redis is not usable right now". OSError covers socket errors redis-py lets through.
_REDIS_DOWN = (RedisError, OSError)


def hash_hex(h: int) -> str:
    """Fixed-width hex of a block hash: the ``{hash}`` part of a block key."""
    return f"{h & 0xFFFFFFFFFFFFFFFF:016x}"


def hashes_hex(hashes: Sequence[int]) -> str:
    """``hash_hex`` of every hash, concatenated; one C-level pack instead of a format call per hash
    (big-endian, so each 16-digit slice equals ``hash_hex``)."""
    return struct.pack(f">{len(hashes)}Q", *hashes).hex()


@dataclass(frozen=True)
class IndexKeys:
    """Key names for one model's index (one place, so publisher, reader and scripts agree)."""

    model_id: str

    @property
    def prefix(self) -> str:
        return f"kvf:{self.model_id}:"

    @property
    def pods(self) -> str:
        return f"{self.prefix}pods"

    def block(self, h: int) -> str:
        return f"{self.prefix}blk:{hash_hex(h)}"

    def pod_blocks(self, pod_id: str) -> str:
        return f"{self.prefix}pod:{pod_id}:blocks"

    def heartbeat(self, pod_id: str) -> str:
        return f"{self.prefix}hb:{pod_id}"


def _client(redis_url: str, timeout_s: float) -> redis.Redis:
    # redis-py's default client retries 10 times with exponential backoff (seconds in total) on a
    # connection error. The router must not stall a request on that, and the publisher has its own
    # backoff and resync, so: no client-side retries, short timeouts, and we decide what a failure means.
    return redis.Redis.from_url(
        redis_url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
    )


# --------------------------------------------------------------------------------------------------
# Server-side scripts. Key names are built inside the scripts from the model prefix instead of being
# passed as KEYS: a match over an 8k-token prompt names ~500 block keys, and building and encoding one
# argument per key dominated the client's cost (redis-py packs each argument in Python). This is fine for
# a standalone Redis (what kvferry deploys); Redis Cluster would need all of a model's keys in one slot.

# The match script is part of the index's contract: the sync reader below and the router's asyncio reader
# (router/prefix_reader.py) both run it, so they answer alike.
# ARGV: prefix, hashes (16 hex digits per block, concatenated), pod_1..pod_n  ->  {count_1..count_n}
# Walk the blocks in order with the pods still matching; a pod drops out at its first miss (a later hit
# is useless: its KV cannot be reused without the blocks before it); stop when no pod is left. One
# SMISMEMBER per block checks all remaining pods in one call.
MATCH_LUA = """
local prefix = ARGV[1]
local hashes = ARGV[2]
local n = #ARGV - 2
local counts = {}
local active_idx = {}
local active_pod = {}
for i = 1, n do
  counts[i] = 0
  local pod = ARGV[2 + i]
  if redis.call('EXISTS', prefix .. 'hb:' .. pod) == 1 then
    active_idx[#active_idx + 1] = i
    active_pod[#active_pod + 1] = pod
  end
end
for j = 1, #hashes, 16 do
  if #active_idx == 0 then break end
  local key = prefix .. 'blk:' .. string.sub(hashes, j, j + 15)
  local hit = redis.call('SMISMEMBER', key, unpack(active_pod))
  local all_hit = true
  for k = 1, #active_idx do
    if hit[k] == 1 then
      local i = active_idx[k]
      counts[i] = counts[i] + 1
    else
      all_hit = false
    end
  end
  if not all_hit then  -- rebuild the active lists only when some pod dropped out
    local next_idx = {}
    local next_pod = {}
    for k = 1, #active_idx do
      if hit[k] == 1 then
        next_idx[#next_idx + 1] = active_idx[k]
        next_pod[#next_pod + 1] = active_pod[k]
      end
    end
    active_idx = next_idx
    active_pod = next_pod
  end
end
return counts
"""

# KEYS: pods registry. ARGV: prefix  ->  {live pods, dead pods} (dead = registered, heartbeat expired).
_POD_STATUS_LUA = """
local live = {}
local dead = {}
for _, pod in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. 'hb:' .. pod) == 1 then
    live[#live + 1] = pod
  else
    dead[#dead + 1] = pod
  end
end
return {live, dead}
"""

# KEYS: pod's blocks set, pod's heartbeat, pods registry. ARGV: prefix, pod, batch, gc flag.
# Removes up to `batch` of the pod's published blocks (the pod id from each block set) and returns how
# many are left. Batched so a pod with a million blocks does not block Redis for a second in one script.
# With the gc flag set (another pod collecting a dead pod's leftovers) each batch first checks the
# heartbeat atomically and returns -1 if the pod came back, so the collector cannot delete entries a
# restarted pod is re-publishing; the registry entry goes only when the last block is gone.
_CLEAR_BATCH_LUA = """
local gc = ARGV[4] == '1'
if gc and redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local popped = redis.call('SPOP', KEYS[1], tonumber(ARGV[3]))
for _, h in ipairs(popped) do
  redis.call('SREM', ARGV[1] .. 'blk:' .. h, ARGV[2])
end
local left = redis.call('SCARD', KEYS[1])
if gc and left == 0 then redis.call('SREM', KEYS[3], ARGV[2]) end
return left
"""

_CLEAR_BATCH = 2000
_SNAPSHOT_CHUNK = 10000


@dataclass
class _OutageLog:
    """Log a Redis outage once when it starts and once when it ends, not once per failed call."""

    what: str
    down: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def failed(self, exc: BaseException) -> None:
        with self.lock:
            if self.down:
                return
            self.down = True
        LOG.warning(
            "%s: Redis unavailable (%s: %s); prefix routing degraded",
            self.what,
            type(exc).__name__,
            exc,
        )

    def ok(self) -> None:
        if not self.down:  # fast path without the lock: the common case on every call
            return
        with self.lock:
            if not self.down:
                return
            self.down = False
        LOG.info("%s: Redis reachable again; prefix index recovered", self.what)


@dataclass
class _Buffer:
    """Events from the scheduler loop, waiting for the publisher thread. Guarded by ``cond``."""

    events: list[tuple[bool, tuple[int, ...]]] = field(default_factory=list)
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
        socket_timeout_s: float = 1.0,
        max_backoff_s: float = 2.0,
        max_buffered_hashes: int = 1_000_000,
        gc_interval_s: float = 30.0,
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
        self._keys = IndexKeys(model_id)
        self._r = _client(redis_url, socket_timeout_s)
        self._clear_batch = self._r.register_script(_CLEAR_BATCH_LUA)
        self._pod_status = self._r.register_script(_POD_STATUS_LUA)
        # Heartbeat value identifying this publisher instance: seeing another value means a second live
        # publisher uses the same pod id (misconfiguration worth a warning).
        self._token = uuid.uuid4().hex
        self._buf = _Buffer()
        self._outage = _OutageLog(f"prefix publisher {pod_id}")
        self._stop = threading.Event()
        self._deregister = True
        self._thread: threading.Thread | None = None
        self._next_heartbeat = 0.0
        self._next_gc = 0.0
        self._warned_duplicate = False

    # ---- called from the scheduler loop -------------------------------------------------------------

    def stored(self, hashes: Iterable[int]) -> None:
        """The cache now holds these blocks. O(len(hashes)), no I/O."""
        self._push(True, hashes)

    def removed(self, hashes: Iterable[int]) -> None:
        """The cache evicted these blocks. O(len(hashes)), no I/O."""
        self._push(False, hashes)

    def _push(self, add: bool, hashes: Iterable[int]) -> None:
        items = tuple(hashes)  # copy: the caller may reuse its list
        if not items:
            return
        b = self._buf
        with b.cond:
            if not b.accepting:
                return
            b.events.append((add, items))
            b.n_hashes += len(items)
            b.pushed += 1
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
            except _REDIS_DOWN as exc:
                self._on_failure(exc)
                backoff = min(self.max_backoff_s, max(0.1, backoff * 2))
            except Exception:  # a bug in resync() or here must not kill the thread
                LOG.exception("prefix publisher %s: unexpected error; will resync", self.pod_id)
                self._on_failure(None)
                backoff = min(self.max_backoff_s, max(0.1, backoff * 2))
            self._stop.wait(backoff or self.flush_interval_s)
        self._shutdown()

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
        snapshot = [hash_hex(h) for h in (self._resync() if self._resync is not None else ())]
        blocks_key = self._keys.pod_blocks(self.pod_id)
        prefix = self._keys.prefix
        for start in range(0, len(snapshot), _SNAPSHOT_CHUNK):
            chunk = snapshot[start : start + _SNAPSHOT_CHUNK]
            pipe = self._r.pipeline(transaction=False)
            for hx in chunk:
                pipe.sadd(f"{prefix}blk:{hx}", self.pod_id)
            pipe.sadd(blocks_key, *chunk)
            pipe.execute()
        with b.cond:
            b.syncing = False
        if snapshot or self._resync is not None:
            LOG.info("prefix publisher %s: synced %d blocks", self.pod_id, len(snapshot))

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
            net: dict[int, bool] = {}
            for add, hashes in events:
                for h in hashes:
                    net[h] = add
            adds = [hash_hex(h) for h, add in net.items() if add]
            dels = [hash_hex(h) for h, add in net.items() if not add]
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
            for hx in adds:
                pipe.sadd(f"{prefix}blk:{hx}", self.pod_id)
            for hx in dels:
                pipe.srem(f"{prefix}blk:{hx}", self.pod_id)
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
        except _REDIS_DOWN as exc:
            # Leftovers stop counting when the heartbeat expires and are collected by the other pods.
            LOG.warning("prefix publisher %s: could not deregister (%s)", self.pod_id, exc)


class PrefixIndexReader:
    """Router-side lookups. Thread-safe (redis-py's connection pool); blocking, so call it from a thread
    or accept one short round trip on the event loop (``socket_timeout_s`` bounds the worst case).

    While Redis is down every call returns None at once without touching the network for a backoff
    period (so requests are not each delayed by a connect timeout), then it tries again by itself.
    """

    def __init__(
        self,
        redis_url: str,
        model_id: str,
        socket_timeout_s: float = 0.2,
        *,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.model_id = model_id
        self.max_backoff_s = max_backoff_s
        self._keys = IndexKeys(model_id)
        self._r = _client(redis_url, socket_timeout_s)
        # register_script computes the SHA locally; each call is one EVALSHA, and after a Redis restart
        # (script cache empty) redis-py loads the script once and retries.
        self._match = self._r.register_script(MATCH_LUA)
        self._pod_status = self._r.register_script(_POD_STATUS_LUA)
        self._outage = _OutageLog("prefix reader")
        self._retry_at = 0.0
        self._backoff = 0.0

    def match(self, block_hashes: Sequence[int], pods: Sequence[str]) -> dict[str, int] | None:
        """For each candidate pod, the number of leading blocks of ``block_hashes`` it holds (0 for a pod
        with an expired heartbeat). One round trip. None if Redis is unavailable."""
        if not pods:
            return {}
        if not block_hashes:
            return {pod: 0 for pod in pods}
        args = [self._keys.prefix, hashes_hex(block_hashes), *pods]
        counts = self._call(lambda: self._match(args=args))
        if counts is None:
            return None
        out: dict[str, int] = {}
        for pod, n in zip(pods, counts, strict=True):
            out[pod] = max(out.get(pod, 0), int(n))
        return out

    def live_pods(self) -> list[str] | None:
        """Pods with a live heartbeat for this model (one round trip). None if Redis is unavailable."""
        res = self._call(lambda: self._pod_status(keys=[self._keys.pods], args=[self._keys.prefix]))
        if res is None:
            return None
        return sorted(p.decode() for p in res[0])

    def close(self) -> None:
        self._r.close()

    def _call(self, fn: Callable[[], list]) -> list | None:
        if self._retry_at and time.monotonic() < self._retry_at:
            return None
        try:
            res = fn()
        except _REDIS_DOWN as exc:
            self._outage.failed(exc)
            self._backoff = min(self.max_backoff_s, max(0.25, self._backoff * 2))
            self._retry_at = time.monotonic() + self._backoff
            return None
        self._retry_at = 0.0
        self._backoff = 0.0
        self._outage.ok()
        return res
