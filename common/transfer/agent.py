"""One worker's NIXL agent: registers its KV pool and keeps the table of peers it may write to. Not
thread-safe: one scheduler loop drives it (NIXL runs without a listener thread, sync mode NONE).
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
import uuid
from dataclasses import dataclass

import nixl._api as nixl_api
from nixl._api import nixl_agent, nixl_agent_config

from common.kv.pool import KVPool
from common.protocol import KVLayoutInfo
from common.transfer.descs import PoolInfo, pool_infos_from_b64, pool_infos_to_b64
from common.transfer.layout import check_compatible, layout_info
from common.transfer.routes import HeadRoute, plan_routes
from common.transfer.staging import StagingArea

log = logging.getLogger(__name__)


class PeerError(ValueError):
    """A handshake whose pieces disagree (name, instance id, geometry) or whose metadata is unusable."""


@dataclass(frozen=True)
class Peer:
    """A remote agent as loaded into NIXL; `instance_id` pins it to one process lifetime."""

    name: str
    instance_id: str
    pools: list[PoolInfo]  # one per tensor-parallel rank of the peer
    routes: list[HeadRoute]  # which local rank feeds each of them
    layout: KVLayoutInfo
    added_at: float
    rank_agents: tuple[str, ...] = ()  # the peer's ranks with their own NIXL agents (loaded here too)

    @property
    def num_pages(self) -> int:
        return self.pools[0].num_pages


# NIXL's progress thread sleeps this long between polls on DRAM pools (its default 0 busy-loops half a core
# idle; UCX moves DRAM bytes inside the post and poll calls); VRAM pools keep 0 until measured on a GPU.
DRAM_PROGRESS_DELAY_US = 100


def _create_nixl_agent(name: str, config: nixl_agent_config, progress_delay_us: int) -> nixl_agent:
    real = nixl_api.nixlBind.nixlAgent

    def with_delay(agent_name: str, agent_config: object) -> object:
        agent_config.pthrDelay = progress_delay_us  # type: ignore[attr-defined]
        return real(agent_name, agent_config)

    nixl_api.nixlBind.nixlAgent = with_delay  # only for this construction (one thread: the engine's start)
    try:
        return nixl_agent(name, config)
    finally:
        nixl_api.nixlBind.nixlAgent = real


class KVTransferAgent:
    """`rank_pools`: the tensor-parallel ranks' pools this agent registers (rank 0's first). `remote_ranks`: ranks
    running their own agents, published in the handshake but never posted from here. `own_heads_only`: this is
    one such rank's agent (common/transfer/rank_agents.py), routing only the peer ranks its heads feed."""

    def __init__(
        self,
        name: str,
        pool: KVPool,
        backend: str = "UCX",
        *,
        model_id: str = "unknown",
        rank_pools: list[tuple[KVPool, tuple[int, int]]] | None = None,
        remote_ranks: list[PoolInfo] | None = None,
        progress_thread: bool = True,
        backend_params: dict[str, str] | None = None,
        staging_bytes: int = 256 << 20,
        progress_delay_us: int | None = None,
        own_heads_only: bool = False,
        model_kv_heads: int | None = None,
    ) -> None:
        """`progress_delay_us`: None = DRAM_PROGRESS_DELAY_US for a DRAM pool, 0 for VRAM."""
        self.name = name
        self.pool = pool
        self.backend = backend
        self.rank_pools = rank_pools or [(pool, (0, pool.layout.num_kv_heads))]
        if self.rank_pools[0][0] is not pool:
            raise ValueError("rank_pools must start with this rank's pool")
        # Fresh per process start: a peer restarted under the same name never gets stale metadata used against it.
        self.instance_id = uuid.uuid4().hex
        self._pool_infos = [
            PoolInfo.from_pool(p, name, self.instance_id, heads, rank)
            for rank, (p, heads) in enumerate(self.rank_pools)
        ] + list(remote_ranks or [])
        self.own_heads_only = own_heads_only
        total_heads = model_kv_heads or max(i.kv_head_end for i in self._pool_infos)
        self.layout = layout_info(pool, model_id, len(self._pool_infos), total_heads)
        self._staging_bytes = staging_bytes
        self.staging: StagingArea | None = None
        self._staging_reg: object | None = None
        self._peers: dict[str, Peer] = {}
        self._closed = False
        if progress_delay_us is None:
            progress_delay_us = DRAM_PROGRESS_DELAY_US if pool.device.type == "cpu" else 0
        self._nixl = _create_nixl_agent(
            name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]), progress_delay_us
        )
        if backend not in self._nixl.plugin_list:
            raise RuntimeError(f"NIXL backend {backend!r} unavailable (plugins: {self._nixl.plugin_list})")
        # Created by hand so backend init parameters (UCX's `num_threads`, ...) can be passed.
        self._nixl.create_backend(backend, dict(backend_params or {}))
        # One registration per rank's pool: every transfer is a sub-range, no per-request registration.
        self._regs = [self._nixl.register_memory(p.kv, backends=[backend]) for p, _ in self.rank_pools]

    @property
    def nixl(self) -> nixl_agent:
        return self._nixl

    @property
    def pool_info(self) -> PoolInfo:
        return self._pool_infos[0]

    @property
    def pool_infos(self) -> list[PoolInfo]:
        return self._pool_infos

    def local_pool(self, rank: int) -> KVPool:
        return self.rank_pools[rank][0]

    def ensure_staging(self) -> StagingArea:
        """The packing area for peers that split heads differently, registered on first use."""
        if self.staging is None:
            self.staging = StagingArea(self._staging_bytes, self.pool.device)
            self._staging_reg = self._nixl.register_memory(self.staging.buf, backends=[self.backend])
        return self.staging

    def metadata_b64(self) -> str:
        # After register_memory: earlier metadata lacks the pool's remote keys (the peer fails with NOT_FOUND).
        return base64.b64encode(self._nixl.get_agent_metadata()).decode("ascii")

    def pool_info_b64(self) -> str:
        return pool_infos_to_b64(self._pool_infos)

    def add_peer(
        self,
        agent_name: str,
        instance_id: str,
        metadata_b64: str,
        pool_info_b64: str,
        layout: KVLayoutInfo,
    ) -> Peer:
        """Loads a peer so this agent can write into its pool; idempotent for the same instance."""
        self._check_open()
        check_compatible(self.layout, layout)
        try:
            infos = pool_infos_from_b64(pool_info_b64)
            metadata = base64.b64decode(metadata_b64.encode("ascii"), validate=True)
        except (ValueError, TypeError, binascii.Error) as e:
            raise PeerError(f"bad handshake from {agent_name!r}: {e}") from e
        info = infos[0]
        if (info.agent_name, info.instance_id) != (agent_name, instance_id):
            raise PeerError(
                f"pool info is for agent {info.agent_name!r} instance {info.instance_id}, "
                f"handshake says agent {agent_name!r} instance {instance_id}"
            )
        if len(infos) != layout.tp_size or info.num_layers != self.pool.layout.num_layers:
            raise PeerError(f"pool geometry of {agent_name!r} disagrees with its declared layout")
        try:
            routes = plan_routes(self._pool_infos, infos, partial=self.own_heads_only)
        except ValueError as e:
            raise PeerError(f"cannot move KV to {agent_name!r}: {e}") from e
        own = self._pool_infos[: len(self.rank_pools)]
        routes = [r for r in routes if any(r.src is i for i in own)]

        known = self._peers.get(agent_name)
        if known is not None:
            if known.instance_id == instance_id:
                return known
            log.info(
                "peer %s restarted (%s -> %s): dropping stale metadata", agent_name, known.instance_id, instance_id
            )
            self.remove_peer(agent_name)

        self._load_remote(metadata, agent_name, f"bad handshake from {agent_name!r}")
        rank_agents = self._load_rank_agents(agent_name, infos)
        if not all(r.direct for r in routes):
            self.ensure_staging()
        peer = Peer(agent_name, instance_id, infos, routes, layout, time.monotonic(), rank_agents)
        self._peers[agent_name] = peer
        return peer

    def _load_remote(self, metadata: bytes, expected: str, context: str) -> None:
        """Loads one remote agent's metadata; PeerError (nothing left loaded) unless it names `expected`."""
        try:
            loaded = self._nixl.add_remote_agent(metadata)
        except Exception as e:  # NIXL refuses metadata it cannot deserialize (nixlMismatchError)
            raise PeerError(f"{context}: NIXL cannot load its metadata ({e})") from e
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != expected:
            if name not in self._peers:
                self._nixl.remove_remote_agent(name)
            raise PeerError(f"{context}: metadata names agent {name!r}, expected {expected!r}")

    def _load_rank_agents(self, peer: str, infos: list[PoolInfo]) -> tuple[str, ...]:
        """Loads the peer's own-agent ranks' metadata; on a bad one unloads everything loaded for the peer."""
        loaded: list[str] = []
        try:
            for info in infos:
                if not info.agent_metadata_b64 or info.agent_name in loaded:
                    continue
                context = f"bad handshake from {peer!r}, rank {info.rank}"
                try:
                    metadata = base64.b64decode(info.agent_metadata_b64.encode("ascii"), validate=True)
                except (ValueError, binascii.Error) as e:
                    raise PeerError(f"{context}: {e}") from e
                self._load_remote(metadata, info.agent_name, context)
                loaded.append(info.agent_name)
        except PeerError:
            for name in (*loaded, peer):
                self._nixl.remove_remote_agent(name)
            raise
        return tuple(loaded)

    def has_peer(self, name: str, instance_id: str | None = None) -> bool:
        peer = self._peers.get(name)
        return peer is not None and (instance_id is None or peer.instance_id == instance_id)

    def peer(self, name: str) -> Peer:
        try:
            return self._peers[name]
        except KeyError:
            raise KeyError(f"unknown transfer peer {name!r}: handshake first") from None

    def remove_peer(self, name: str) -> bool:
        """Forgets a peer and disconnects; in-flight writes to it will report an error."""
        peer = self._peers.pop(name, None)
        if peer is None:
            return False
        for agent in (name, *peer.rank_agents):
            try:
                self._nixl.remove_remote_agent(agent)
            except Exception as e:  # already gone on the NIXL side: the table entry was the thing to drop
                log.warning("remove_remote_agent(%s): %s", agent, e)
        return True

    def close(self) -> None:
        """Drops peers and deregisters the pool; release transfer handles (KVSender.close) first."""
        if self._closed:
            return
        self._closed = True
        for name in list(self._peers):
            self.remove_peer(name)
        regs = [*self._regs, *([self._staging_reg] if self._staging_reg is not None else [])]
        for reg in regs:
            try:
                self._nixl.deregister_memory(reg, backends=[self.backend])
            except Exception as e:
                log.warning("deregister_memory: %s", e)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"transfer agent {self.name!r} is closed")

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
