"""`GpuPath`: what `ModelRunner.forward` runs when the flashinfer backend is selected."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.gpu.attention import WORKSPACE_BYTES, FlashInferAttention
from common.engine.layers import FlashInferOps

if TYPE_CHECKING:
    from common.engine.runner import ModelRunner

log = logging.getLogger("kvferry.engine")


class GpuPath:
    """flashinfer attention + fused kernels (the model's forward with `FlashInferOps`) for every step; CUDA
    graphs for decode steps that fit. flashinfer's kernels serve 16-bit dtypes only: float32 on a GPU runs the
    plain torch path (`select_attention` picks it), without this class and without CUDA graphs.

    `dummy_page` is a pool page outside the allocator's range: CUDA-graph padding rows write there.
    `use_graphs` can be switched off at run time (the benchmark's ablation) without recapturing.
    """

    def __init__(self, runner: ModelRunner, dummy_page: int, graph_max_bs: int) -> None:
        if runner.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"the flashinfer backend needs bfloat16 or float16, not {runner.dtype}; use attention=torch"
            )
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
        self.model.ops = FlashInferOps(self.model.rotary)
        self.graphs = None
        self.use_graphs = True
        if graph_max_bs > 0 and dev.type == "cuda":
            from common.engine.gpu.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self, graph_max_bs)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.use_graphs and self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        self.attn.plan(batch)
        return self.model(batch, self.attn)
