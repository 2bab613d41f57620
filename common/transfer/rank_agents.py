"""Tensor-parallel ranks with NIXL agents of their own.

A GPU rank's KV pool can be registered with NIXL only by the process that owns the memory, so on GPUs
every follower rank runs its own agent over its own pool and a peer writes into each rank directly.
Each follower publishes its agent's pool info (with the agent's metadata) in the group's key-value store
(a TCPStore); rank 0 collects them and lists them in its handshake next to its own pool
(`KVTransferAgent(remote_ranks=...)`). Such a worker receives KV (decode) into every rank directly and sends
it (prefill) from every rank: rank 0 posts its own heads and tells the followers to post theirs
(common/worker/rank_writes.py). On the CPU the ranks' pools are shared memory that rank 0 registers itself
(the default there).

The caller (the serving layer, which owns both the model runner and the transfer) passes in the rank's
pool, its KV heads and the store: transfer knows nothing of the engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from datetime import timedelta
from typing import Protocol

from common.kv.pool import KVPool
from common.transfer.agent import KVTransferAgent
from common.transfer.descs import PoolInfo

KEY = "kvferry/rank-agent/{rank}"


class RankStore(Protocol):
    """What is used of the group's store (torch.distributed.Store)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...

    def check(self, keys: list[str]) -> bool: ...

    def delete_key(self, key: str) -> bool: ...


def rank_agent_name(base: str, rank: int) -> str:
    return f"{base}-r{rank}"


def publish_rank_agent(
    store: RankStore,
    rank: int,
    pool: KVPool,
    kv_heads: tuple[int, int],
    model_id: str,
    base_name: str,
    model_kv_heads: int | None = None,
) -> KVTransferAgent:
    """Follower side: an agent over rank `rank`'s pool (holding model KV heads `kv_heads` of `model_kv_heads`),
    announced to rank 0."""
    agent = KVTransferAgent(
        rank_agent_name(base_name, rank),
        pool,
        model_id=model_id,
        rank_pools=[(pool, kv_heads)],
        own_heads_only=True,
        model_kv_heads=model_kv_heads,
    )
    info = replace(agent.pool_info, rank=rank, agent_metadata_b64=agent.metadata_b64())
    store.set(KEY.format(rank=rank), json.dumps(asdict(info)))
    return agent


def collect_rank_agents(store: RankStore, world_size: int, timeout_s: float = 300.0) -> list[PoolInfo]:
    """Rank 0 side: every follower's pool info, waiting for the followers to publish them."""
    keys = [KEY.format(rank=r) for r in range(1, world_size)]
    store.wait(keys, timedelta(seconds=timeout_s))
    return [PoolInfo.from_dict(json.loads(store.get(k))) for k in keys]
