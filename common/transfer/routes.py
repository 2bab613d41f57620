"""Which local rank's pool feeds which remote rank's pool when the workers split KV heads differently: each
remote rank is fed by the one local rank containing its heads (a narrower range packed first); a range
straddling two local ranks is refused at the handshake.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.transfer.descs import PoolInfo


@dataclass(frozen=True)
class HeadRoute:
    src: PoolInfo  # the local rank's pool
    dst: PoolInfo  # the remote rank's pool

    @property
    def head_offset(self) -> int:
        return self.dst.kv_head_start - self.src.kv_head_start

    @property
    def direct(self) -> bool:
        return (self.src.kv_head_start, self.src.kv_head_end) == (self.dst.kv_head_start, self.dst.kv_head_end)


def plan_routes(local: list[PoolInfo], remote: list[PoolInfo], partial: bool = False) -> list[HeadRoute]:
    """One route per remote rank; ValueError when one cannot be fed by one local rank. `partial`: `local` is one
    rank's own agent, so remote ranks outside its heads are skipped."""
    heads = max(i.kv_head_end for i in local)
    if not partial and max(i.kv_head_end for i in remote) != heads:
        raise ValueError(f"the peer's pools hold {max(i.kv_head_end for i in remote)} KV heads, this worker's {heads}")
    routes = []
    for dst in remote:
        src = next(
            (s for s in local if s.kv_head_start <= dst.kv_head_start and dst.kv_head_end <= s.kv_head_end), None
        )
        if src is None and partial:
            continue
        if src is None:
            raise ValueError(
                f"peer rank {dst.rank} holds KV heads [{dst.kv_head_start}, {dst.kv_head_end}), which no single "
                f"rank of this worker holds (this worker's TP size is {len(local)}, the peer's {len(remote)}; "
                "the decode worker's tensor-parallel size must be at least the prefill worker's)"
            )
        if dst.page_stride * src.kv_heads != src.page_stride * dst.kv_heads:
            raise ValueError(f"peer rank {dst.rank}'s page size in bytes does not match its KV heads")
        routes.append(HeadRoute(src, dst))
    return routes
