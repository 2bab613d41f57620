"""Tensor parallelism: how a model is split over ranks, and the collectives the split needs (docs/architecture.md,
"Tensor parallelism"): attention by KV-head groups (no communication), qkv and gate/up column-parallel, o and down
row-parallel (all-reduced), experts split inside each, embedding and LM head vocab-parallel. Groups are built on a
TCPStore, not `init_process_group`, so one process may hold several.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from common.engine.model_config import ModelConfig

if TYPE_CHECKING:
    from common.settings import RunnerConfig


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """The `index`-th of `parts` contiguous near-equal pieces of range(n) (earlier pieces get the extra)."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of `size` owns; ranges are [lo, hi) over the full model's heads / rows."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # rows of the vocabulary this rank holds (the last rank's may be short)
    vocab_per_rank: int  # every rank's slice is padded to this many rows, so logits gather evenly
    moe_intermediate: tuple[int, int] = (0, 0)  # of every expert's intermediate dim (mixtures of experts)

    @classmethod
    def plan(cls, cfg: ModelConfig, rank: int, size: int) -> TPShard:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        if cfg.mla is not None and size > 1:
            # Every head reads the one latent entry: splitting heads would replicate the cache on every rank.
            raise ValueError(
                f"{cfg.model_type}: latent attention (MLA) runs on one rank; tensor parallelism is not supported"
            )
        kv, q = cfg.num_kv_heads, cfg.num_heads
        group = q // kv
        if kv >= size:
            kv_lo, kv_hi = split_range(kv, size, rank)
            q_lo, q_hi = kv_lo * group, kv_hi * group
        else:
            if size % kv:
                raise ValueError(f"tensor parallel size {size} must divide or be at most the {kv} KV heads")
            replicas = size // kv
            if group < replicas:
                raise ValueError(f"tensor parallel size {size} exceeds the {q} query heads")
            head = rank // replicas
            kv_lo, kv_hi = head, head + 1
            g_lo, g_hi = split_range(group, replicas, rank % replicas)
            q_lo, q_hi = head * group + g_lo, head * group + g_hi
        per_rank = -(-cfg.vocab_size // size)
        v_lo = min(rank * per_rank, cfg.vocab_size)
        return cls(
            rank=rank,
            size=size,
            q_heads=(q_lo, q_hi),
            kv_heads=(kv_lo, kv_hi),
            intermediate=split_range(cfg.intermediate_size, size, rank),
            vocab=(v_lo, min(v_lo + per_rank, cfg.vocab_size)),
            vocab_per_rank=per_rank,
            moe_intermediate=split_range(cfg.moe.intermediate_size, size, rank) if cfg.moe else (0, 0),
        )

    @classmethod
    def single(cls, cfg: ModelConfig) -> TPShard:
        return cls.plan(cfg, 0, 1)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config this rank's layers are built with (vocab_size stays the full vocabulary)."""
        lo, hi = self.moe_intermediate
        return replace(
            cfg,
            num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            moe=replace(cfg.moe, intermediate_size=hi - lo) if cfg.moe else None,
        )

    def rows(self, full: torch.Tensor, lo: int, hi: int, unit: int = 1, pad_to: int = 0) -> torch.Tensor:
        part = full[lo * unit : hi * unit]
        if pad_to > part.shape[0]:
            pad = torch.zeros((pad_to - part.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
            part = torch.cat((part, pad))
        return part

    def hf_slice(self, kind: str, full: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """This rank's part of one checkpoint tensor, by projection kind."""
        d = cfg.head_dim
        if kind == "q":
            return self.rows(full, *self.q_heads, unit=d)
        if kind in ("k", "v"):
            return self.rows(full, *self.kv_heads, unit=d)
        if kind == "o":
            return full[:, self.q_heads[0] * d : self.q_heads[1] * d]
        if kind in ("gate", "up"):
            return self.rows(full, *self.intermediate)
        if kind == "down":
            return full[:, self.intermediate[0] : self.intermediate[1]]
        if kind == "vocab":
            return self.rows(full, *self.vocab, pad_to=self.vocab_per_rank)
        lo, hi = self.moe_intermediate
        if kind in ("expert_gate", "expert_up"):
            return full[lo:hi]
        if kind == "expert_down":
            return full[:, lo:hi]
        if kind == "experts_w13":  # [E, 2I, H]: each expert's gate rows, then its up rows
            gate, up = full.chunk(2, dim=1)
            return torch.cat((gate[:, lo:hi], up[:, lo:hi]), dim=1)
        if kind == "experts_w2":
            return full[:, :, lo:hi]
        return full

    def merged_slice(self, param: str, full: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        if self.size == 1:
            return full  # the whole of it (and latent attention's merged [q_a; kv_a], which runs on one rank)
        leaf = param.rsplit(".", 1)[-1]
        if leaf in ("qkv_proj", "qkv_bias"):
            q, kv = full.split((cfg.q_size, 2 * cfg.kv_size))
            k, v = kv.split((cfg.kv_size, cfg.kv_size))
            return torch.cat([self.hf_slice(n, t, cfg) for n, t in (("q", q), ("k", k), ("v", v))])
        if leaf == "gate_up_proj":
            gate, up = full.chunk(2)
            return torch.cat((self.hf_slice("gate", gate, cfg), self.hf_slice("up", up, cfg)))
        kind = {"o_proj": "o", "down_proj": "down", "embed": "vocab", "lm_head": "vocab"}.get(leaf, "none")
        kind = {"w13": "experts_w13", "w2": "experts_w2"}.get(leaf, kind)
        return self.hf_slice(kind, full, cfg)


def tp_backend(cfg: RunnerConfig) -> str:
    if not cfg.device.startswith("cuda"):
        return "gloo"
    return "gloo-via-host" if cfg.tp_same_device else "nccl"


class TPGroup:
    """Collectives of one tensor-parallel group (`size == 1`: no-ops): `pg` for the model's (gloo or NCCL, whose
    timeout bounds a step stuck on a lost rank), `ctrl` (gloo) for rank 0's per-step broadcast, waiting unbounded."""

    def __init__(
        self, shard: TPShard, pg: object | None = None, ctrl: object | None = None, via_host: bool = False
    ) -> None:
        self.shard = shard
        self.rank = shard.rank
        self.size = shard.size
        self.pg = pg
        self.ctrl = ctrl if ctrl is not None else pg
        # gloo over GPU tensors (ranks sharing one GPU, functional runs): each collective goes through the host.
        self.via_host = via_host
        self.store: object | None = None  # the TCPStore the group was built on (rank 0 serves it)

    @staticmethod
    def serve_store(host: str, size: int, timeout_s: float = 120.0) -> Any:
        """Rank 0's TCPStore, listening on a port the OS picks (its `.port`) before any other rank is started: a
        port picked free and bound later can be taken meanwhile, by a rank's own connection attempts among others
        (a client that retries a loopback port in the ephemeral range can connect to itself)."""
        import torch.distributed as dist

        return dist.TCPStore(host, 0, size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)

    @classmethod
    def connect(
        cls, shard: TPShard, host: str, port: int, backend: str, timeout_s: float = 120.0, store: Any = None
    ) -> TPGroup:
        """Joins the group whose rank 0 hosts a TCPStore at host:port (gloo, nccl, or gloo-via-host); `store`:
        rank 0's own, already listening (`serve_store`)."""
        import torch.distributed as dist

        if store is None:
            store = dist.TCPStore(host, port, shard.size, shard.rank == 0, timeout=timedelta(seconds=timeout_s))
        model_store = dist.PrefixStore("model", store)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)  # a lost rank fails the step instead of hanging it
            pg = dist.ProcessGroupNCCL(model_store, shard.rank, shard.size, opts)
        else:
            pg = dist.ProcessGroupGloo(model_store, shard.rank, shard.size, timedelta(seconds=timeout_s))
        ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), shard.rank, shard.size, timedelta(days=365))
        group = cls(shard, pg, ctrl, via_host=backend == "gloo-via-host")
        group.store = store  # the store must outlive the groups (rank 0 serves it)
        if backend == "nccl":
            # Created now: the first forward may be a CUDA-graph capture, where NCCL set-up must not happen.
            group.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())))
            torch.cuda.synchronize()
        return group

    def close(self) -> None:
        """Tears the communicators down by abort: a graceful NCCL teardown hung once a peer had stopped."""
        for pg in {id(p): p for p in (self.pg, self.ctrl) if p is not None}.values():
            for name in ("abort", "shutdown"):
                fn = getattr(pg, name, None)
                if fn is not None:
                    try:
                        fn()
                        break
                    except Exception:  # noqa: S112 (best effort: the process is going away)
                        continue
        self.pg = self.ctrl = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.via_host:
            host = x.cpu()
            self.pg.allreduce([host]).wait()  # type: ignore[attr-defined]
            return x.copy_(host)
        self.pg.allreduce([x]).wait()  # type: ignore[attr-defined]
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """From rank 0 to all, in place, over the control group (CPU tensors)."""
        if self.size > 1:
            self.ctrl.broadcast(x, 0).wait()  # type: ignore[attr-defined]
        return x

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding lookup: each token's row comes from the one rank holding it."""
        if self.size == 1:
            return F.embedding(ids, weight)
        lo, hi = self.shard.vocab
        local = ids - lo
        outside = (local < 0) | (local >= hi - lo)
        out = F.embedding(local.masked_fill(outside, 0), weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.all_reduce(out)

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        if self.size == 1:
            return local
        src = local.cpu() if self.via_host else local.contiguous()
        parts = [torch.empty_like(src) for _ in range(self.size)]
        self.pg.allgather([parts], [src]).wait()  # type: ignore[attr-defined]
        return torch.cat(parts, dim=-1)[:, :vocab_size].to(local.device)


def single_rank(cfg: ModelConfig) -> TPGroup:
    return TPGroup(TPShard.single(cfg))
