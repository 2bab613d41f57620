"""Decode steps as CUDA graphs, captured at start for a ladder of batch sizes.

A decode step of B requests runs the graph of the smallest captured size bs >= B. Its inputs live in
static buffers (token ids, positions, KV write locations; flashinfer's page metadata in buffers the
per-size decode wrappers were built over); the B - bs padding rows write their K/V to the pool's dummy
page (one page past the allocator's range) and attend only to it. Graphs are captured largest first and
share one memory pool; logits land in one static float32 buffer shared by all sizes.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.gpu.attention import FlashInferAttention, GraphBuffers, PageMeta
from common.engine.gpu.graph_inputs import GraphInputs, smallest_fit
from common.engine.gpu.mla_attention import FlashInferMlaAttention

if TYPE_CHECKING:
    from common.engine.model import DecoderModel
    from common.kv.pool import KVPool

log = logging.getLogger("kvferry.engine")


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to `max_bs` (always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderModel,
        attn: FlashInferAttention | FlashInferMlaAttention,
        pool: KVPool,
        dummy_page: int,
        max_seq_len: int,
        max_bs: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.attn = attn
        self.pool = pool
        self.dummy_page = dummy_page
        self.max_bs = max_bs
        self.sizes = graph_batch_sizes(max_bs)
        dev = model.device
        ps = pool.layout.page_size
        self.inputs = GraphInputs.allocate(max_bs, pool, dummy_page, dev)
        self.logits = torch.zeros(max_bs, model.cfg.vocab_size, dtype=torch.float32, device=dev)
        pages_per_req = -(-max_seq_len // ps)
        self.indptr_buf = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.indices_buf = torch.zeros(max_bs * pages_per_req + max_bs, dtype=torch.int32, device=dev)
        self.last_buf = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.wrappers = {
            bs: self.attn.make_decode_wrapper(self._buffers(bs), self.attn.decode_tensor_cores(bs)) for bs in self.sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        if capture:
            self.capture()

    def pick(self, b: int) -> int:
        return smallest_fit(self.sizes, b, "a decode batch")

    def can_run(self, batch: ForwardBatch) -> bool:
        # Every token sampled, in order (a decode step from the scheduler always is).
        return (
            batch.is_decode
            and batch.batch_size <= self.max_bs
            and batch.logits_indices.shape[0] == batch.num_tokens == batch.batch_size
        )

    def _buffers(self, bs: int) -> GraphBuffers:
        return self.indptr_buf[: bs + 1], self.indices_buf, self.last_buf[:bs]

    def _body(self, bs: int) -> None:
        inp = self.inputs
        self.attn.bind(self.wrappers[bs], inp.out_loc[:bs], self._buffers(bs))
        # Logits in the model's dtype, cast by the copy into the float32 buffer (one kernel, not two).
        logits = self.model.forward_tokens(inp.input_ids[:bs], inp.positions[:bs], self.attn, float_logits=False)
        self.logits[:bs].copy_(logits)

    def _plan_dummy(self, bs: int) -> None:
        none = torch.zeros(0, dtype=torch.int32)
        empty = PageMeta(torch.zeros(1, dtype=torch.int32), none.to(self.inputs.input_ids.device), none)
        meta = empty.padded(bs, self.dummy_page)
        self.inputs.out_loc[:bs].fill_(self.inputs.dummy_slot)
        self.attn.plan_decode(self.wrappers[bs], meta)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        sizes = sorted(self.sizes, reverse=True)
        for n, bs in enumerate(sizes, 1):
            self._plan_dummy(bs)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._body(bs)  # warm-up outside the graph (lazy inits, autotuning)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._body(bs)
            self.graphs[bs] = graph
            log.info("captured decode graph %d/%d (batch %d)", n, len(sizes), bs)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d decode graphs in %.1f s", len(sizes), self.capture_seconds)

    def run(self, batch: ForwardBatch, replay: bool = True) -> torch.Tensor:
        """Logits [B, vocab] float32: a view of the static buffer, valid until the next decode step."""
        b = batch.batch_size
        bs = self.pick(b)
        self.inputs.load(batch, self.pool, bs)
        meta = self.attn.step_meta(batch).padded(bs, self.dummy_page)
        if self.attn.xqa is not None:
            # XQA reads the CSR buffers themselves (its dense table is derived inside the graph): flashinfer's plan,
            # which would copy them there and schedule a kernel the graph does not run, is skipped.
            self.indptr_buf[: bs + 1].copy_(meta.indptr, non_blocking=True)
            self.indices_buf[: meta.indices.numel()].copy_(meta.indices, non_blocking=True)
            self.last_buf[:bs].copy_(meta.last_page_len, non_blocking=True)
        else:
            self.attn.plan_decode(self.wrappers[bs], meta)
        if replay:
            self.graphs[bs].replay()
        else:
            self._body(bs)  # the same kernels on the same buffers, launched eagerly
        return self.logits[:b]
