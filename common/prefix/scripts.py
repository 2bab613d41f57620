"""The prefix index's contract with Redis: key names and the server-side scripts.

The index says which worker pod holds which chained block hash (common/prefix/hashing.py). Workers write it
(common/prefix/publisher.py), routers read it (common/prefix/reader.py); both build every key and run every
script from here, so they agree. The index is a routing hint, never a correctness input: a stale entry only
costs a cache miss on the chosen pod, and a missing Redis only means routing on load alone.

Keys (``kvf`` is the deployment's prefix, KVFERRY_REDIS_PREFIX: common/prefix/access.py; ``{model}`` is the
model id, ``{hash}`` the 16-digit lowercase hex of a 64-bit block hash):

- ``kvf:{model}:blk:{hash}``: SET of pod ids holding that block in device memory.
- ``kvf:{model}:hblk:{hash}``: SET of pod ids holding that block in their host-memory tier (common/kv/
  host_tier.py): reusable after a copy back, cheaper than recomputing, dearer than a device hit. A pod is
  in at most one of the two sets of a block. Added beside ``blk:`` rather than changing it, so a reader
  that knows only ``blk:`` still reads device hits right (and a host hit as a miss).
- ``kvf:{model}:pod:{pod}:blocks``: SET of the hashes (hex) this pod published (either tier), so the pod's
  entries can be removed without scanning the keyspace (restart, graceful drain, garbage collection).
- ``kvf:{model}:hb:{pod}``: heartbeat STRING with a TTL; a pod whose heartbeat expired counts as holding
  nothing, whatever its block entries say (it crashed, or lost Redis and its entries are stale).
- ``kvf:{model}:pods``: SET of pod ids that have published, so live pods can be listed and a dead pod's
  leftover entries garbage-collected without SCAN.

Requires Redis >= 6.2 (SMISMEMBER, SET ... GET, SPOP with count).

Key names are built inside the scripts from the model prefix instead of being passed as KEYS: a match over
an 8k-token prompt names ~500 block keys, and building and encoding one argument per key dominated the
client's cost (redis-py packs each argument in Python). This is fine for a standalone Redis (what kvferry
deploys); Redis Cluster would need all of a model's keys in one slot.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from common.prefix.access import DEFAULT_KEY_PREFIX

__all__ = ["CLEAR_BATCH_LUA", "MATCH_LUA", "POD_STATUS_LUA", "IndexKeys", "hash_hex", "hashes_hex"]


def hash_hex(h: int) -> str:
    """Fixed-width hex of a block hash: the ``{hash}`` part of a block key."""
    return f"{h & 0xFFFFFFFFFFFFFFFF:016x}"


def hashes_hex(hashes: Sequence[int]) -> str:
    """``hash_hex`` of every hash, concatenated; one C-level pack instead of a format call per hash
    (big-endian, so each 16-digit slice equals ``hash_hex``)."""
    return struct.pack(f">{len(hashes)}Q", *hashes).hex()


@dataclass(frozen=True)
class IndexKeys:
    """Key names for one model's index in one deployment (``deployment``: KVFERRY_REDIS_PREFIX, so two
    installs sharing a Redis never see each other's pods or blocks)."""

    model_id: str
    deployment: str = DEFAULT_KEY_PREFIX

    @property
    def prefix(self) -> str:
        return f"{self.deployment}:{self.model_id}:"

    @property
    def pods(self) -> str:
        return f"{self.prefix}pods"

    def block(self, h: int) -> str:
        return f"{self.prefix}blk:{hash_hex(h)}"

    def host_block(self, h: int) -> str:
        return f"{self.prefix}hblk:{hash_hex(h)}"

    def pod_blocks(self, pod_id: str) -> str:
        return f"{self.prefix}pod:{pod_id}:blocks"

    def heartbeat(self, pod_id: str) -> str:
        return f"{self.prefix}hb:{pod_id}"


# ARGV: prefix, hashes (16 hex digits per block, concatenated), pod_1..pod_n
#   ->  {device_1, host_1, ..., device_n, host_n}
# Walk the blocks in order with the pods still matching; a pod drops out at its first miss in both tiers (a
# later hit is useless: its KV cannot be reused without the blocks before it); stop when no pod is left. One
# SMISMEMBER per block checks all remaining pods' device entries, and a second one, only when some missed,
# their host entries. A pod's count is its device hits then its host hits (a pod's host blocks extend its
# device ones: common/kv/radix.py keeps the device part of the tree on top).
MATCH_LUA = """
local prefix = ARGV[1]
local hashes = ARGV[2]
local n = #ARGV - 2
local device = {}
local host = {}
local active_idx = {}
local active_pod = {}
for i = 1, n do
  device[i] = 0
  host[i] = 0
  local pod = ARGV[2 + i]
  if redis.call('EXISTS', prefix .. 'hb:' .. pod) == 1 then
    active_idx[#active_idx + 1] = i
    active_pod[#active_pod + 1] = pod
  end
end
for j = 1, #hashes, 16 do
  if #active_idx == 0 then break end
  local h = string.sub(hashes, j, j + 15)
  local hit = redis.call('SMISMEMBER', prefix .. 'blk:' .. h, unpack(active_pod))
  local missed = {}
  for k = 1, #active_idx do
    if hit[k] == 1 then
      device[active_idx[k]] = device[active_idx[k]] + 1
    else
      missed[#missed + 1] = k
    end
  end
  if #missed > 0 then
    local pods = {}
    for m = 1, #missed do pods[m] = active_pod[missed[m]] end
    local on_host = redis.call('SMISMEMBER', prefix .. 'hblk:' .. h, unpack(pods))
    local next_idx = {}
    local next_pod = {}
    local m = 1
    for k = 1, #active_idx do
      local keep = true
      if missed[m] == k then
        keep = on_host[m] == 1
        if keep then host[active_idx[k]] = host[active_idx[k]] + 1 end
        m = m + 1
      end
      if keep then
        next_idx[#next_idx + 1] = active_idx[k]
        next_pod[#next_pod + 1] = active_pod[k]
      end
    end
    active_idx = next_idx
    active_pod = next_pod
  end
end
local out = {}
for i = 1, n do
  out[2 * i - 1] = device[i]
  out[2 * i] = host[i]
end
return out
"""

# KEYS: pods registry. ARGV: prefix  ->  {live pods, dead pods} (dead = registered, heartbeat expired).
POD_STATUS_LUA = """
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
CLEAR_BATCH_LUA = """
local gc = ARGV[4] == '1'
if gc and redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local popped = redis.call('SPOP', KEYS[1], tonumber(ARGV[3]))
for _, h in ipairs(popped) do
  redis.call('SREM', ARGV[1] .. 'blk:' .. h, ARGV[2])
  redis.call('SREM', ARGV[1] .. 'hblk:' .. h, ARGV[2])
end
local left = redis.call('SCARD', KEYS[1])
if gc and left == 0 then redis.call('SREM', KEYS[3], ARGV[2]) end
return left
"""
