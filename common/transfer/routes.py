"""Which local rank's pool feeds which remote rank's pool when the two workers split KV heads differently.

Each remote (decode) rank holds a contiguous range of the model's KV heads; it is fed by the one local
(prefill) rank whose range contains it. Equal ranges move pages as they are (one descriptor per run of
pages); a narrower destination range is packed first (`common/transfer/staging.py`) into the
destination's page layout, then moved the same way. A destination range that straddles two local ranks
(e.g. prefill TP=2 into decode TP=1) is refused at the handshake: decode TP must be at least prefill TP,
with ranks that nest.
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
        """First destination head, counted within the source rank's heads."""
        return self.dst.kv_head_start - self.src.kv_head_start

    @property
    def direct(self) -> bool:
        return (self.src.kv_head_start, self.src.kv_head_end) == (self.dst.kv_head_start, self.dst.kv_head_end)


def plan_routes(local: list[PoolInfo], remote: list[PoolInfo], partial: bool = False) -> list[HeadRoute]:
    """One route per remote rank; raises ValueError when some remote rank cannot be fed by one local rank.
    `partial`: `local` is some of this worker's ranks only (one rank's own agent): remote ranks outside their
    heads are skipped, not refused (the worker's rank 0 checks the whole)."""
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
