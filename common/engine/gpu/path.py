"""`GpuPath`: what `ModelRunner.forward` runs when the flashinfer backend is selected."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.gpu.attention import WORKSPACE_BYTES, FlashInferAttention
from common.engine.gpu.mla_attention import SPLIT_DECODE_MAX_BS, FlashInferMlaAttention
from common.engine.gpu.moe_experts import grouped_mm_experts, grouped_mm_unsupported
from common.engine.gpu.ops import FlashInferOps
from common.engine.model import DecoderModel
from common.engine.moe import ExpertsFn, RouteFn, route
from common.engine.start_phases import StartPhases
from common.kv.pool import KVPool
from common.settings import RunnerConfig

log = logging.getLogger("kvferry.engine")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def pdl_available(device: torch.device, triton: bool) -> bool:
    """Programmatic dependent launches for every kernel the path runs: flashinfer's need compute capability 9.0;
    the Triton kernels, where they run, also a Triton that launches that way."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    if not triton:
        return True
    from common.engine.gpu import pdl  # Triton: imported only where it is

    return pdl.triton_launches_pdl()


class GpuPath:
    """flashinfer attention + fused kernels (the model's forward with `FlashInferOps`) for every step; CUDA
    graphs for decode steps that fit, piecewise graphs (all but attention) for prefill and mixed steps that fit
    (common/engine/gpu/step_graphs.py; one rank only). flashinfer's kernels serve 16-bit dtypes only: float32 on
    a GPU runs the plain torch path (`select_attention` picks it), without this class and without CUDA graphs.

    `page_table` is the runner's `[rows, max_seq_len]` token-location table; `dummy_page` a pool page outside
    the allocator's range: CUDA-graph padding rows write there; `cfg` gives the kernel switches (decode
    tensor-core threshold, the Triton kernels); `host_pages` the table's page ids on the host (`PageTable.host_pages`),
    which latent attention's planner reads. `use_graphs` can be switched off at run time
    (the benchmark's ablation) without recapturing.
    """

    def __init__(
        self,
        model: DecoderModel,
        pool: KVPool,
        page_table: torch.Tensor,
        dummy_page: int,
        graph_max_bs: int,
        cfg: RunnerConfig,
        host_pages: np.ndarray | None = None,
        phases: StartPhases | None = None,
    ) -> None:
        if model.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"the flashinfer backend needs bfloat16 or float16, not {model.dtype}; use attention=torch"
            )
        triton = cfg.fused_kernels and triton_available()
        self.moe_gemv_max_tokens = self._install_experts(model, cfg, triton)
        self.model = model
        phases = phases if phases is not None else StartPhases()
        kernels_started = time.perf_counter()
        self.pdl = cfg.pdl and pdl_available(model.device, triton)
        # first: it sets how flashinfer is imported
        model.ops = FlashInferOps(
            cfg.gemv_max_rows if triton else 0,
            fold_prologues=cfg.gemv_prologues,
            pdl=self.pdl,
            stream_stats=cfg.gemv_stream_stats,
            gated_epilogue=cfg.gemv_gated,
            rope_epilogue=cfg.gemv_rope,
        )
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=model.device)
        self.attn = self._attention(model, pool, page_table, host_pages, cfg, triton)
        phases.record("kernels", time.perf_counter() - kernels_started)
        graphs_started = time.perf_counter()
        self.use_graphs = True
        self._capture(pool, dummy_page, page_table.shape[1], graph_max_bs, cfg.cuda_graph_max_tokens)
        if self.graphs is not None or self.step_graphs is not None:
            phases.record("graphs", time.perf_counter() - graphs_started)
        self._log_kernels(pool, triton, graph_max_bs)

    @staticmethod
    def _install_experts(model: DecoderModel, cfg: RunnerConfig, triton: bool) -> int:
        """Sets every MoE layer's experts and routing to device paths that keep CUDA graphs (the plain experts
        sync on the host); returns the most tokens the GEMV experts take (0: grouped GEMMs only)."""
        if model.cfg.moe is None:
            return 0
        why = grouped_mm_unsupported(model.device, model.dtype)
        if why is not None:
            raise ValueError(f"{model.cfg.model_type}: {why}; use attention=torch")
        experts_fn: ExpertsFn = grouped_mm_experts
        route_fn: RouteFn = route
        gemv_tokens = 0
        if triton and cfg.gemv_max_rows > 0 and cfg.gemv_experts:
            # Triton: imported only when used
            from common.engine.gpu.moe_gemv import MAX_TOKENS, SERVING_TOKENS, DecodeExperts
            from common.engine.gpu.moe_route import DecodeRoute, softmax_top_k_fits

            gemv_tokens = min(cfg.gemv_max_rows, MAX_TOKENS, SERVING_TOKENS)
            experts_fn = DecodeExperts(gemv_tokens, grouped_mm_experts)
            if softmax_top_k_fits(model.cfg.moe):
                route_fn = DecodeRoute(min(cfg.gemv_max_rows, MAX_TOKENS))
        for layer in model.layers:
            if layer.moe is not None:
                layer.moe.experts_fn = experts_fn
                layer.moe.route_fn = route_fn
        return gemv_tokens

    def _attention(
        self,
        model: DecoderModel,
        pool: KVPool,
        page_table: torch.Tensor,
        host_pages: np.ndarray | None,
        cfg: RunnerConfig,
        triton: bool,
    ) -> FlashInferAttention | FlashInferMlaAttention:
        if model.cfg.mla is not None:
            if host_pages is None:
                raise ValueError("latent attention on flashinfer plans from the page table's host copy (host_pages)")
            split_max_bs = SPLIT_DECODE_MAX_BS if triton and cfg.mla_split_decode else 0
            return FlashInferMlaAttention(
                pool,
                host_pages,
                model.cfg,
                model.dtype,
                self.workspace,
                model.rotary,
                split_max_bs,
                self.pdl,
                cfg.mla_decompressed_prefill,
            )
        return FlashInferAttention(
            pool,
            page_table,
            model.cfg,
            model.dtype,
            self.workspace,
            model.rotary,
            cfg.decode_tc_min_batch,
            triton,
            self.pdl,
        )

    def _capture(self, pool: KVPool, dummy_page: int, max_seq_len: int, graph_max_bs: int, step_tokens: int) -> None:
        model = self.model
        self.graphs = None
        self.step_graphs = None
        if graph_max_bs > 0 and model.device.type == "cuda":
            from common.engine.gpu.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.attn, pool, dummy_page, max_seq_len, graph_max_bs)
        if step_tokens > 0 and model.device.type == "cuda" and model.tp.size == 1:
            from common.engine.gpu.step_graphs import StepGraphs

            self.step_graphs = StepGraphs(model, self.attn, pool, dummy_page, step_tokens)

    def _log_kernels(self, pool: KVPool, triton: bool, graph_max_bs: int) -> None:
        attn, model = self.attn, self.model
        decode = "xqa" if attn.xqa is not None else "flashinfer"
        if attn.xqa is None and attn.triton_decode is not None:
            decode = "triton (1-2 rows), flashinfer"
        prefill = "fa3 e4m3" if attn.fp8_prefill else "flashinfer"
        if isinstance(attn, FlashInferMlaAttention):
            prefill = decode = f"flashinfer mla {attn.backend} (absorbed)"
            if attn.split_decode_max_bs:
                decode = f"triton split-kv mla (1-{attn.split_decode_max_bs} rows), {decode}"
            if attn.decompressed_prefill:
                prefill += ", ragged prefill (decompressed: eager chunks with no cached prefix)"
        log.info(
            "gpu kernels",
            extra={
                "kv_dtype": str(pool.layout.dtype).removeprefix("torch."),
                "fp8_weights": model.fp8_weights,
                "prefill_attention": prefill,
                "decode_attention": decode,
                "fused_kernels": triton,
                "moe_gemv_max_tokens": self.moe_gemv_max_tokens,
                "pdl": self.pdl,
                "decode_graphs_max_bs": graph_max_bs if self.graphs is not None else 0,
                "step_graphs_max_tokens": self.step_graphs.max_tokens if self.step_graphs is not None else 0,
            },
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.scored_rows:  # graphs are captured for sampled rows only: a scored prompt runs eagerly
            self.attn.plan(batch)
            return self.model(batch, self.attn)
        if self.use_graphs and self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        if self.use_graphs and self.step_graphs is not None and self.step_graphs.can_run(batch):
            return self.step_graphs.run(batch)
        self.attn.plan(batch)
        return self.model(batch, self.attn)
