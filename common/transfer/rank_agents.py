"""Tensor-parallel ranks with NIXL agents of their own.

A GPU rank's KV pool can be registered with NIXL only by the process that owns the memory, so on GPUs
every follower rank runs its own agent over its own pool and a peer writes into each rank directly.
Each follower publishes its agent's pool info (with the agent's metadata) in the group's TCPStore; rank 0
collects them and lists them in its handshake next to its own pool (`KVTransferAgent(remote_ranks=...)`).
Such a worker receives KV (decode) but does not send it: sending would need each rank to post its own
writes. On the CPU the ranks' pools are shared memory that rank 0 registers itself (the default there).
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from datetime import timedelta

from common.engine.runner import ModelRunner
from common.transfer.agent import KVTransferAgent
from common.transfer.descs import PoolInfo

KEY = "kvferry/rank-agent/{rank}"


def rank_agent_name(base: str, rank: int) -> str:
    return f"{base}-r{rank}"


def publish_rank_agent(runner: ModelRunner, base_name: str) -> KVTransferAgent:
    """Follower side: an agent over this rank's pool, announced to rank 0."""
    shard = runner.tp.shard
    agent = KVTransferAgent(
        rank_agent_name(base_name, shard.rank),
        runner.pool,
        model_id=runner.cfg.model,
        rank_pools=[(runner.pool, shard.kv_heads)],
    )
    info = replace(agent.pool_info, rank=shard.rank, agent_metadata_b64=agent.metadata_b64())
    runner.tp.store.set(KEY.format(rank=shard.rank), json.dumps(asdict(info)))  # type: ignore[attr-defined]
    return agent


def collect_rank_agents(runner: ModelRunner, timeout_s: float = 300.0) -> list[PoolInfo]:
    """Rank 0 side: every follower's pool info, waiting for the followers to publish them."""
    keys = [KEY.format(rank=r) for r in range(1, runner.tp.size)]
    store = runner.tp.store
    store.wait(keys, timedelta(seconds=timeout_s))  # type: ignore[attr-defined]
    return [PoolInfo.from_dict(json.loads(store.get(k))) for k in keys]  # type: ignore[attr-defined]
