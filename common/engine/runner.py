"""Model runner: owns the model, the KV pool, the page table and the attention backend; runs steps."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.engine.attention import AttentionBackend, TorchPagedAttention
from common.engine.forward_batch import ForwardBatch
from common.engine.model import DecoderModel
from common.engine.model_config import ModelConfig, named_config
from common.engine.weights import init_dummy_weights, load_safetensors_dir
from common.kv.pool import KVLayout, KVPool
from common.sched.pages import PageTable

log = logging.getLogger("kvferry.engine")


@dataclass
class RunnerConfig:
    model: str = "smollm2-135m-instruct"  # the default's name, a local HF dir, or "dummy:<named config>"
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    page_size: int = 16
    num_pages: int = 0  # 0: from kv_memory_gb
    kv_memory_gb: float = 1.0
    max_running: int = 64
    max_seq_len: int = 0  # 0: the model's context length
    seed: int = 0
    attention: str = "auto"  # auto: flashinfer on CUDA with a 16-bit dtype, else torch; or "torch" / "flashinfer"
    cuda_graph_max_bs: int = -1  # GPU path: decode CUDA graphs up to this batch (-1: max_running, 0: none)
    cpu_linear: str = "auto"  # CPU float32 GEMMs: auto = oneDNN with packed weights when available; torch = F.linear


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def select_attention(name: str, device: torch.device, dtype: torch.dtype) -> str:
    if name == "auto":
        fits = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        return "flashinfer" if fits else "torch"
    if name not in ("torch", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r}; use auto, torch or flashinfer")
    return name


def load_model(cfg: RunnerConfig, device: torch.device, dtype: torch.dtype) -> tuple[DecoderModel, Path | None]:
    """Returns the model and the directory it came from (None for dummy weights)."""
    start = time.perf_counter()
    if cfg.model.startswith("dummy:"):
        model_cfg = named_config(cfg.model.removeprefix("dummy:"))
        model = DecoderModel(model_cfg, dtype, device)
        init_dummy_weights(model, cfg.seed)
        path = None
    else:
        from common.engine.default_model import resolve_model_path

        path = resolve_model_path(cfg.model)
        model = DecoderModel(ModelConfig.from_dir(path), dtype, device)
        load_safetensors_dir(model, path)
    log.info("model loaded", extra={"model": cfg.model, "seconds": round(time.perf_counter() - start, 2)})
    return model, path


class ModelRunner:
    def __init__(self, cfg: RunnerConfig, model: DecoderModel | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.model_path: Path | None = None
        if model is None:
            model, self.model_path = load_model(cfg, self.device, self.dtype)
        self.model = model
        mc = model.cfg
        self.model_config = mc
        self.max_seq_len = cfg.max_seq_len or mc.max_position
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.page_size, self.dtype)
        num_pages = cfg.num_pages or KVPool.pages_for_bytes(self.layout, int(cfg.kv_memory_gb * (1 << 30)))
        self.backend = select_attention(cfg.attention, self.device, self.dtype)
        gpu = self.backend == "flashinfer"
        # The GPU path keeps one page past the allocator's range (`num_pages`): CUDA-graph padding writes there.
        self.pool = KVPool(self.layout, num_pages + int(gpu), self.device)
        self.pool.num_pages = num_pages
        self.page_table = PageTable(cfg.max_running, self.max_seq_len, cfg.page_size, self.device)
        self.attn: AttentionBackend = TorchPagedAttention(self.pool, self.page_table.table, mc.num_heads, mc.head_dim)
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
            self.gpu = GpuPath(self, dummy_page=num_pages, graph_max_bs=graph_bs)
            self.attn = self.gpu.attn

    def build_batch(
        self,
        token_chunks: list[list[int]],
        starts: list[int],
        table_rows: list[int],
        sample_mask: list[bool],
        is_decode: bool,
    ) -> ForwardBatch:
        """Packs one step: request i feeds `token_chunks[i]` at positions starting at `starts[i]`."""
        dev = self.device
        extend = [len(c) for c in token_chunks]
        seq = [s + n for s, n in zip(starts, extend)]
        ids = torch.tensor([t for c in token_chunks for t in c], dtype=torch.int64)
        ext_t = torch.tensor(extend, dtype=torch.int64)
        start_t = torch.tensor(starts, dtype=torch.int64)
        rows_t = torch.tensor(table_rows, dtype=torch.int64)
        q_start = torch.cumsum(ext_t, 0) - ext_t
        positions = torch.arange(int(ext_t.sum()), dtype=torch.int64) - torch.repeat_interleave(
            q_start - start_t, ext_t
        )
        token_rows = torch.repeat_interleave(rows_t, ext_t)
        # Host-to-device copies are non-blocking: a blocking one would wait for every step already queued.
        nb = dict(non_blocking=True)
        positions_dev = positions.to(dev, **nb)
        out_loc = self.page_table.table[token_rows.to(dev, **nb), positions_dev].to(torch.int64)
        last = q_start + ext_t - 1
        logits_indices = last[torch.tensor(sample_mask, dtype=torch.bool)]
        return ForwardBatch(
            is_decode=is_decode,
            input_ids=ids.to(dev, **nb),
            positions=positions_dev,
            out_loc=out_loc,
            seq_lens=torch.tensor(seq, dtype=torch.int64).to(dev, **nb),
            extend_lens=ext_t.to(dev, **nb),
            q_start=q_start.to(dev, **nb),
            table_rows=rows_t.to(dev, **nb),
            logits_indices=logits_indices.to(dev, **nb),
            seq_lens_cpu=seq,
            extend_lens_cpu=extend,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.gpu is not None:
            return self.gpu.forward(batch)
        self.attn.plan(batch)
        return self.model(batch, self.attn)
