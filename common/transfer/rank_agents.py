"""Tensor-parallel ranks with NIXL agents of their own: only the process owning a GPU's memory can register it,
so each follower publishes its agent's pool info in the group's store and rank 0 lists them in its handshake.
The caller passes pool, heads and store: transfer knows nothing of the engine.
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
    """Follower side: an agent over rank `rank`'s pool, announced to rank 0."""
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
    keys = [KEY.format(rank=r) for r in range(1, world_size)]
    store.wait(keys, timedelta(seconds=timeout_s))
    return [PoolInfo.from_dict(json.loads(store.get(k))) for k in keys]
