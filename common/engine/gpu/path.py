"""`GpuPath`: what `ModelRunner.forward` runs when the flashinfer backend is selected."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.gpu.attention import WORKSPACE_BYTES, FlashInferAttention
from common.engine.gpu.fused import cos_sin_cache, fused_forward

if TYPE_CHECKING:
    from common.engine.runner import ModelRunner

log = logging.getLogger("kvferry.engine")


class GpuPath:
    """flashinfer attention + fused kernels for every step; CUDA graphs for decode steps that fit.

    `dummy_page` is a pool page outside the allocator's range: CUDA-graph padding rows write there.
    `use_graphs` can be switched off at run time (the benchmark's ablation) without recapturing.
    """

    def __init__(self, runner: ModelRunner, dummy_page: int, graph_max_bs: int) -> None:
        # The CUDA norm kernels (what the bundle precompiles), not the CuTe-DSL ones.
        os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
        self.runner = runner
        self.model = runner.model
        self.dummy_page = dummy_page
        dev = runner.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.attn = FlashInferAttention(
            runner.pool,
            runner.page_table.table,
            runner.model_config,
            runner.dtype,
            self.workspace,
            tc_min_batch=runner.cfg.decode_tc_min_batch,
        )
        self.cos_sin = cos_sin_cache(self.model)
        self.graphs = None
        self.use_graphs = True
        if graph_max_bs > 0 and dev.type == "cuda":
            from common.engine.gpu.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self, graph_max_bs)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.use_graphs and self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        self.attn.plan(batch)
        # A decode step samples every token in order: no gather needed before the final norm.
        all_tokens = batch.is_decode and batch.logits_indices.shape[0] == batch.num_tokens
        indices = None if all_tokens else batch.logits_indices
        return fused_forward(self.model, batch.input_ids, batch.positions, self.attn, self.cos_sin, indices)
