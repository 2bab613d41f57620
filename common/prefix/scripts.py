"""The prefix index's contract with Redis: key names and the server-side scripts (a routing hint, never a
correctness input: a stale entry costs a cache miss, a missing Redis means routing on load).

Keys (``kvf``: KVFERRY_REDIS_PREFIX; ``{hash}``: 16 lowercase hex digits):
- ``kvf:{model}:blk:{hash}`` / ``hblk:{hash}``: SETs of pods holding the block on the device / in the host
  tier (a pod in at most one; ``hblk:`` added beside so old readers see a host hit as a miss).
- ``kvf:{model}:pod:{pod}:blocks``: SET of the hashes a pod published, to remove them without a scan.
- ``kvf:{model}:hb:{pod}``: heartbeat with a TTL; an expired pod holds nothing, whatever its entries say.
- ``kvf:{model}:pods``: SET of pods that published, to list them and collect dead ones without SCAN.
Requires Redis >= 6.2. Scripts build key names from the prefix (passing ~500 keys as KEYS dominated the
client's cost), so all of a model's keys would need one slot in a Redis Cluster.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from common.prefix.access import DEFAULT_KEY_PREFIX

__all__ = ["CLEAR_BATCH_LUA", "MATCH_LUA", "POD_STATUS_LUA", "IndexKeys", "hash_hex", "hashes_hex"]


def hash_hex(h: int) -> str:
    return f"{h & 0xFFFFFFFFFFFFFFFF:016x}"


def hashes_hex(hashes: Sequence[int]) -> str:
    """``hash_hex`` of every hash, concatenated, in one C-level pack (big-endian: each slice equals ``hash_hex``)."""
    return struct.pack(f">{len(hashes)}Q", *hashes).hex()


@dataclass(frozen=True)
class IndexKeys:
    """Key names for one model's index in one deployment (two installs may share a Redis)."""

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
# Blocks in order; a pod drops out at its first miss in both tiers (its KV past a gap is useless), counting its
# device hits then its host hits (the radix cache keeps the device part on top). One SMISMEMBER per block.
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
# Removes up to `batch` of the pod's blocks (a million in one script would block Redis) and returns how many are
# left. With gc set each batch first checks the heartbeat atomically (-1: the pod came back and re-publishes).
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
