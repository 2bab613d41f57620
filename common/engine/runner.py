"""Model runner: owns the model, the KV pool, the page table and the attention backend; runs steps."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from common.engine.attention import AttentionBackend, TorchPagedAttention
from common.engine.dtypes import resolve_dtype, resolve_kv_dtype
from common.engine.forward_batch import ForwardBatch, StepInputs
from common.engine.fp8 import FP8_SETTING, fp8_unsupported, is_fp8
from common.engine.kv_sizing import kv_pool_pages, model_kv_layout
from common.engine.mla import TorchMlaAttention
from common.engine.model import DecoderModel
from common.engine.model_config import ModelConfig
from common.engine.named_configs import named_config
from common.engine.staging import HostToDevice
from common.engine.start_phases import StartPhases
from common.engine.tp import TPGroup, TPShard, tp_backend
from common.engine.tp_ranks import HEADER_LEN, TPFollowers, TPRankLost, shared_pool_path
from common.engine.weights import fp8_checkpoint, init_dummy_weights, load_safetensors_dir
from common.kv.page_table import PageTable
from common.kv.pool import KVLayout, KVPool
from common.settings import RunnerConfig
from common.settings_registry import ATTENTION, KV_DTYPE, WEIGHT_DTYPE

log = logging.getLogger("kvferry.engine")


def select_attention(name: str, device: torch.device, dtype: torch.dtype) -> str:
    if name == "auto":
        fits = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        return "flashinfer" if fits else "torch"
    if name not in ("torch", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r}; use auto, torch or flashinfer")
    return name


def resolve_model_config(cfg: RunnerConfig) -> tuple[ModelConfig, Path | None]:
    """The full model's config and the directory its weights are in (None for dummy weights)."""
    if cfg.model.startswith("dummy:"):
        return named_config(cfg.model.removeprefix("dummy:")), None
    from common.default_model import resolve_model_path

    path = resolve_model_path(cfg.model)
    return ModelConfig.from_dir(path), path


def load_model(
    cfg: RunnerConfig, device: torch.device, dtype: torch.dtype, tp: TPGroup | None = None
) -> tuple[DecoderModel, Path | None]:
    """Returns the model (this rank's part of it under tensor parallelism) and its directory (None: dummy)."""
    start = time.perf_counter()
    model_cfg, path = resolve_model_config(cfg)
    if cfg.weight_dtype not in ("auto", FP8_SETTING):
        raise ValueError(f"unknown weight dtype {cfg.weight_dtype!r}; use auto or {FP8_SETTING}")
    no_fp8 = fp8_unsupported(device)
    if cfg.weight_dtype == FP8_SETTING and no_fp8:
        raise ValueError(f"{WEIGHT_DTYPE.name}={FP8_SETTING}: {no_fp8}; use auto")
    checkpoint = fp8_checkpoint(path) if path is not None else None
    # Mixtures of experts and latent attention have no FP8 GEMM path: block-scaled FP8 checkpoints (DeepSeek's
    # format) are dequantized at load into the model's dtype.
    plain_only = model_cfg.moe is not None or model_cfg.mla is not None
    if plain_only and cfg.weight_dtype == FP8_SETTING:
        raise ValueError(f"{model_cfg.model_type}: FP8 experts are not supported yet; serve 16-bit weights")
    if plain_only and checkpoint is not None and checkpoint.weight_strategy != "block":
        raise ValueError(
            f"{model_cfg.model_type}: FP8 checkpoints of this family load from 128 x 128 block scales "
            f"(weight_block_size, dequantized at load), not per-{checkpoint.weight_strategy} scales"
        )
    dequantize = plain_only and checkpoint is not None
    model = DecoderModel(model_cfg, dtype, device, tp, fp8_weights=checkpoint is not None and not dequantize)
    if path is None:
        init_dummy_weights(model, cfg.seed)
    else:
        load_safetensors_dir(model, path, checkpoint.block if checkpoint is not None else None)
    if dequantize:
        log.info("FP8 block-scaled checkpoint dequantized to %s at load", str(dtype).removeprefix("torch."))
    if model.fp8_weights and no_fp8:  # the checkpoint users downloaded still serves, at 16-bit weights' cost
        log.warning("FP8 checkpoint dequantized to %s at load: %s", str(dtype).removeprefix("torch."), no_fp8)
        model.dequantize_linears()
    if cfg.weight_dtype == FP8_SETTING and not model.fp8_weights:
        model.quantize_linears()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the 16-bit copies' memory back to the device, before the KV pool is sized
    log.info(
        "model loaded",
        extra={
            "model": cfg.model,
            "tp_rank": cfg.tp_rank,
            "fp8_weights": model.fp8_weights,
            "seconds": round(time.perf_counter() - start, 2),
        },
    )
    return model, path


class ModelRunner:
    """One rank's model, KV pool and page table. Under tensor parallelism (`cfg.tp_size > 1`) rank 0's runner
    launches the followers and broadcasts every step to them (common/engine/tp_ranks.py); `rank_pools`
    then lists every rank's pool (CPU: mapped from shared memory) for the transfer agent."""

    def __init__(self, cfg: RunnerConfig, model: DecoderModel | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if cfg.tp_size > 1 and self.device.type == "cuda" and not cfg.tp_same_device:
            self.device = torch.device("cuda", cfg.tp_rank)  # one GPU per rank
            torch.cuda.set_device(self.device)  # NCCL binds each rank's communicator to the current device
        elif self.device.type == "cuda" and self.device.index is not None:
            # Kernels, streams and CUDA-graph capture follow the current device: with several GPUs visible,
            # `cuda:1` must be current or capture begins and ends on different devices' streams.
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        no_fp8 = fp8_unsupported(self.device) if is_fp8(resolve_kv_dtype(cfg.kv_dtype, self.dtype)) else None
        if no_fp8:  # before any weight is read
            raise ValueError(f"{KV_DTYPE.name}={cfg.kv_dtype}: {no_fp8}; use auto")
        self.model_path: Path | None = None
        self.start_phases = StartPhases()  # what its start took, phase by phase (common/engine/start_phases.py)
        self.followers: TPFollowers | None = None
        tp: TPGroup | None = None
        if cfg.tp_size > 1:
            if model is not None:
                raise ValueError("tensor parallelism loads its own model on every rank")
            full_cfg, _ = resolve_model_config(cfg)
            if cfg.tp_rank == 0:
                self.followers = TPFollowers.launch(cfg, full_cfg)
                tp = self.followers.group
            else:
                tp = TPGroup.connect(
                    TPShard.plan(full_cfg, cfg.tp_rank, cfg.tp_size), "127.0.0.1", cfg.tp_port, tp_backend(cfg)
                )
        try:
            self._build(cfg, model, tp)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: RunnerConfig, model: DecoderModel | None, tp: TPGroup | None) -> None:
        if model is None:
            with self.start_phases.timed("weights"):
                model, self.model_path = load_model(cfg, self.device, self.dtype, tp)
        self.model = model
        self.tp = model.tp
        mc = model.cfg
        self.model_config = mc
        self.max_seq_len = cfg.max_seq_len or mc.max_position
        # What every rank of the group holds (this rank's own is `self.tp.shard`).
        self.rank_shards = [TPShard.plan(model.full_cfg, r, self.tp.size) for r in range(self.tp.size)]
        self.layout = self._rank_layout(self.tp.shard)
        # Every rank needs the same page count: size it by rank 0's layout, which holds the most KV heads.
        widest_layout = self._rank_layout(self.rank_shards[0])
        num_pages = kv_pool_pages(widest_layout, cfg.kv_memory_gb, cfg.num_pages, self.device)
        if self.tp.size > 1 and not cfg.num_pages and not cfg.kv_memory_gb:
            # Sized from each rank's free memory: every rank takes the smallest (all must hold the same pages).
            mine = torch.zeros(self.tp.size, dtype=torch.int64, device=self.device)
            mine[self.tp.shard.rank] = num_pages
            num_pages = int(self.tp.all_reduce(mine).min())
        self.backend = select_attention(cfg.attention, self.device, self.dtype)
        gpu = self.backend == "flashinfer"
        if mc.mla is not None and is_fp8(self.layout.dtype):
            # Unscaled e4m3 latents lose too much (untested against a real checkpoint): refuse rather than guess.
            raise ValueError(
                f"{mc.model_type}: an FP8 latent (MLA) cache is not supported yet; set {KV_DTYPE.name}=auto"
            )
        if gpu and mc.mla is not None:
            from common.engine.gpu.mla_attention import flashinfer_mla_unsupported  # imports no flashinfer

            why = flashinfer_mla_unsupported(self.model.cfg)
            if why is not None:
                raise ValueError(f"{mc.model_type}: {why}; set {ATTENTION.name}=torch to run it with the torch backend")
        # The GPU path keeps one page past the allocator's range (`num_pages`): CUDA-graph padding writes there.
        if self.tp.size > 1 and self.device.type == "cpu":
            prefix = cfg.tp_shm if cfg.tp_rank > 0 else self.followers.shm_prefix  # type: ignore[union-attr]
            path = shared_pool_path(prefix, cfg.tp_rank)
            self.pool = KVPool.in_shared_file(self.layout, num_pages + int(gpu), path, create=True)
        else:
            with self.start_phases.timed("kv_pool"):
                self.pool = KVPool(self.layout, num_pages + int(gpu), self.device)
        self.pool.num_pages = num_pages
        self.rank_pools: list[KVPool] = [self.pool]
        self.page_table = PageTable(
            cfg.max_running, self.max_seq_len, cfg.page_size, self.device, host_pages=gpu and mc.mla is not None
        )
        self.h2d = HostToDevice(self.device)  # each step's inputs and page-table writes: one copy
        self.attn: AttentionBackend = (
            TorchPagedAttention(self.pool, self.page_table.table, mc.num_heads, mc.head_dim, model.rotary)
            if mc.mla is None
            else TorchMlaAttention(self.pool, self.page_table.table, mc.num_heads, mc.mla, model.rotary)
        )
        if cfg.cpu_linear not in ("auto", "torch"):
            raise ValueError(f"unknown cpu_linear {cfg.cpu_linear!r}; use auto or torch")
        if self.backend == "torch" and cfg.cpu_linear == "auto":
            model.pack_linears()  # a no-op off the CPU
        elif self.backend == "torch":
            model.unpack_linears()
        self.gpu = None
        if gpu:
            from common.engine.gpu.path import GpuPath

            graph_bs = cfg.max_running if cfg.cuda_graph_max_bs < 0 else min(cfg.cuda_graph_max_bs, cfg.max_running)
            table = self.page_table
            self.gpu = GpuPath(
                model,
                self.pool,
                table.table,
                num_pages,
                graph_bs,
                cfg,
                host_pages=table.host_pages,
                phases=self.start_phases,
            )
            self.attn = self.gpu.attn
        if self.followers is not None:
            self.followers.barrier_ready()
            self.rank_pools = [self.pool, *self._map_follower_pools(num_pages + int(gpu))]
            self.page_table.journal = []
        elif self.tp.size > 1:
            self.tp.broadcast(torch.zeros(HEADER_LEN, dtype=torch.int64))  # answer rank 0's READY barrier

    def _rank_layout(self, shard: TPShard) -> KVLayout:
        full = self.model.full_cfg
        heads = shard.kv_heads[1] - shard.kv_heads[0]
        kv_dtype = resolve_kv_dtype(self.cfg.kv_dtype, self.dtype)
        scales = self.model.kv_scales if is_fp8(kv_dtype) else ()
        return model_kv_layout(full, self.cfg.page_size, kv_dtype, heads, scales)

    def _map_follower_pools(self, num_pages: int) -> list[KVPool]:
        """CPU: every follower's pool, mapped from its shared-memory file (the files are unlinked once mapped)."""
        if self.device.type != "cpu":
            return []  # GPU ranks' pools stay private to their processes (cross-rank registration: see docs)
        assert self.followers is not None
        pools = []
        for rank in range(1, self.tp.size):
            path = shared_pool_path(self.followers.shm_prefix, rank)
            pool = KVPool.in_shared_file(self._rank_layout(self.rank_shards[rank]), num_pages, path, create=False)
            pool.num_pages = self.pool.num_pages
            pools.append(pool)
        for rank in range(self.tp.size):
            try:
                os.unlink(shared_pool_path(self.followers.shm_prefix, rank))
            except FileNotFoundError:
                pass
        return pools

    @property
    def graphed_step_tokens(self) -> int:
        """The most tokens (prompt tokens and decode rows) a prefill or mixed step runs as piecewise graphs; 0 when
        none is (the CPU, tensor parallelism, graphs off)."""
        graphs = self.gpu.step_graphs if self.gpu is not None else None
        return graphs.max_tokens if graphs is not None and self.gpu.use_graphs else 0  # type: ignore[union-attr]

    @property
    def per_rank_agents(self) -> bool:
        """Whether follower ranks register their own pools with NIXL (see common/transfer/rank_agents.py)."""
        if self.tp.size == 1:
            return False
        mode = self.cfg.tp_transfer
        if mode not in ("auto", "shared", "per-rank"):
            raise ValueError(f"unknown tp_transfer {mode!r}; use auto, shared or per-rank")
        if mode == "shared" and self.device.type != "cpu":
            raise ValueError("tp_transfer=shared needs CPU ranks (GPU pools cannot be mapped by rank 0)")
        return mode == "per-rank" or (mode == "auto" and self.device.type != "cpu")

    def kv_rank_pools(self) -> list[tuple[KVPool, tuple[int, int]]]:
        """The KV pools rank 0's transfer agent registers, with the model KV heads each holds: every rank's
        (shared memory) or, with per-rank agents, rank 0's own."""
        pools = self.rank_pools[:1] if self.per_rank_agents else self.rank_pools
        return [(pool, shard.kv_heads) for pool, shard in zip(pools, self.rank_shards)]

    def kv_checksums(self, pages: torch.Tensor) -> list[float] | None:
        """Per-page float64 sums over every rank's heads (debug checks that transferred pages arrived intact);
        None where rank 0 cannot read the other ranks' pools (GPU tensor parallelism)."""
        if len(self.rank_pools) != self.tp.size:
            return None
        distinct: dict[tuple[int, int], KVPool] = {}
        for pool, shard in zip(self.rank_pools, self.rank_shards):
            distinct.setdefault(shard.kv_heads, pool)  # a replicated KV head counts once
        sums = [pool.page_checksums(pages) for pool in distinct.values()]
        return torch.stack(sums).sum(0).tolist()

    def close(self) -> None:
        """Stops the follower ranks (rank 0 of a tensor-parallel runner); a no-op otherwise."""
        if self.followers is not None:
            self.followers.close()

    def build_batch(
        self,
        token_chunks: list[list[int]],
        starts: list[int],
        table_rows: list[int],
        sample_mask: list[bool],
        is_decode: bool,
        all_logits: bool = False,
        score_lens: list[int] | None = None,
    ) -> ForwardBatch:
        """Packs one step: request i feeds `token_chunks[i]` at positions starting at `starts[i]`; with
        `score_lens`, the logits of request i's first `score_lens[i]` tokens follow the sampled rows."""
        inputs = StepInputs(
            is_decode=is_decode,
            input_ids=torch.tensor([t for c in token_chunks for t in c], dtype=torch.int64),
            extend_lens=torch.tensor([len(c) for c in token_chunks], dtype=torch.int64),
            starts=torch.tensor(starts, dtype=torch.int64),
            table_rows=torch.tensor(table_rows, dtype=torch.int64),
            sample_mask=torch.tensor(sample_mask, dtype=torch.bool),
            all_logits=all_logits,
            score_lens=torch.tensor(score_lens, dtype=torch.int64) if score_lens is not None else None,
        )
        return self.batch_from_inputs(inputs)

    def batch_from_inputs(self, inputs: StepInputs) -> ForwardBatch:
        """The step on the device: its index arrays worked out on the host (numpy, no per-token Python), then
        sent with the page table's pending writes in one copy (common/engine/staging.py)."""
        ext = inputs.extend_lens.numpy()
        start = inputs.starts.numpy()
        rows = inputs.table_rows.numpy()
        seq = start + ext
        q_start = np.cumsum(ext) - ext
        total = int(inputs.input_ids.shape[0])
        if total == len(ext):  # one token each (decode rows): no expansion
            positions, token_rows = start, rows
        else:
            positions = np.arange(total, dtype=np.int64) - np.repeat(q_start - start, ext)
            token_rows = np.repeat(rows, ext)
        last = q_start + ext - 1
        logits_indices = np.arange(total, dtype=np.int64) if inputs.all_logits else last[inputs.sample_mask.numpy()]
        scored = 0
        if inputs.score_lens is not None:
            n = inputs.score_lens.numpy()
            scored = int(n.sum())
            # Request i's scored tokens are q_start[i] + 0 .. n[i]-1: one arange, shifted per request.
            ends = np.cumsum(n)
            scored_at = np.arange(scored, dtype=np.int64) + np.repeat(q_start - (ends - n), n)
            logits_indices = np.concatenate((logits_indices, scored_at))
        at, pages = self.page_table.take_writes()
        stage = self.h2d.stage()
        for part in (inputs.input_ids, positions, token_rows, seq, ext, q_start, rows, logits_indices, at, pages):
            stage.put(part, torch.int64)
        ids_d, pos_d, token_rows_d, seq_d, ext_d, q_start_d, rows_d, logits_d, at_d, pages_d = stage.send()
        self.page_table.apply_writes(at_d, pages_d)
        out_loc = self.page_table.table[token_rows_d, pos_d].to(torch.int64)
        return ForwardBatch(
            is_decode=inputs.is_decode,
            input_ids=ids_d,
            positions=pos_d,
            out_loc=out_loc,
            seq_lens=seq_d,
            extend_lens=ext_d,
            q_start=q_start_d,
            table_rows=rows_d,
            logits_indices=logits_d,
            seq_lens_cpu=seq.tolist(),
            extend_lens_cpu=ext.tolist(),
            inputs=inputs,
            scored_rows=scored,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs one step on every rank; returns float32 logits of the sampled tokens (full vocabulary)."""
        if self.followers is None:
            return self.forward_local(batch)
        if batch.inputs is None:
            raise ValueError("a tensor-parallel step needs its StepInputs (build it with build_batch)")
        try:
            self.followers.send_step(batch.inputs, self.page_table.drain_journal())
            return self.forward_local(batch)
        except TPRankLost:
            raise
        except RuntimeError:
            # A collective that failed because a rank died (connection reset, timeout) is a lost rank.
            self.followers.check_alive(wait_s=2.0)
            raise

    @torch.inference_mode()
    def forward_local(self, batch: ForwardBatch) -> torch.Tensor:
        if self.gpu is not None:
            return self.gpu.forward(batch)
        self.attn.plan(batch)
        return self.model(batch, self.attn)
