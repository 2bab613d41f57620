"""A worker's tensor-parallel follower rank: the engine's follower plus, where the ranks' pools are private
to their processes (GPUs), a NIXL agent over this rank's pool (common/transfer/rank_agents.py), which posts
this rank's KV writes when rank 0 of a prefill worker asks (common/worker/rank_writes.py).

A worker's engine host names this module as `RunnerConfig.tp_follower_main`, so rank 0 starts its followers
as `python -m common.worker.tp_follower <config JSON>`.
"""

from __future__ import annotations

import json
import sys
from typing import NoReturn

from common.engine.tp_follower import Follower
from common.transfer.rank_agents import publish_rank_agent
from common.worker.rank_writes import RankSender


def main(argv: list[str]) -> NoReturn:
    follower = Follower.start(json.loads(argv[0]))
    runner = follower.runner
    if not (runner.per_rank_agents and runner.cfg.tp_agent_name):
        follower.serve()
    shard = runner.tp.shard
    agent = publish_rank_agent(
        runner.tp.store,  # type: ignore[arg-type]  (a torch.distributed.TCPStore once the group is connected)
        shard.rank,
        runner.pool,
        shard.kv_heads,
        runner.cfg.model,
        runner.cfg.tp_agent_name,
        runner.model.full_cfg.num_kv_heads,
    )
    # Rank 0 of a prefill worker has this rank post its own heads' writes (common/worker/rank_writes.py).
    writes = RankSender(agent, runner.tp.store, shard.rank)  # type: ignore[arg-type]
    follower.serve(on_stop=agent.close, on_side=writes.handle, on_idle=writes.progress)


if __name__ == "__main__":
    main(sys.argv[1:])
