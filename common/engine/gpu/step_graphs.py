"""Prefill and mixed steps as piecewise CUDA graphs: everything but attention captured, per token count.

An eager 8B forward launches ~300 kernels from Python, a floor that set a mixed step's time. Attention's plan
follows the batch's shape, but everything around it depends only on the token count, so for a ladder of counts
the layers are captured as `L + 1` graphs broken at each layer's attention (or MLA's absorbed attention), which
runs eagerly between them from static buffers. A step replays the smallest count >= its tokens; padding rows
write K/V to the dummy page and are never read. The residual stream is the only activation crossing a break.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.gpu.attention import FlashInferAttention
from common.engine.gpu.graph_inputs import GraphInputs, smallest_fit
from common.engine.gpu.mla_attention import FlashInferMlaAttention
from common.engine.layers import KvWrite
from common.engine.mla import MlaParts, MlaProjections

if TYPE_CHECKING:
    from common.engine.model import DecoderModel
    from common.kv.pool import KVPool

log = logging.getLogger("kvferry.engine")


def graph_token_counts(max_tokens: int) -> list[int]:
    """Every 16 tokens up to 512, every 64 up to 1,024, then every 128, plus `max_tokens`. Padding is computed for
    nothing: a graphed 8B step of 513-1,025 tokens took ~6% longer on the device than an eager one, hence the fine
    steps. The default limit still runs those graphed: an eager step's time follows the host's launches, and
    under serving load its tail, not its median, sets the chunk budget (docs/architecture.md)."""
    if max_tokens <= 0:
        return []
    ladder = [*range(16, 513, 16), *range(576, 1025, 64), *range(1152, max_tokens, 128)]
    return sorted({t for t in ladder if t < max_tokens} | {max_tokens})


class _BreakAtAttention:
    """The attention backend the model sees while captured: writes K/V and the rotated q inside the current graph,
    then ends it and begins the next. Outside capture (`graphs` None) it runs the pieces eagerly, with the planned
    attention over `attend_rows` rows in between (the replay's twin) or none (the warm-up)."""

    def __init__(
        self, owner: StepGraphs, tokens: int, graphs: list[torch.cuda.CUDAGraph] | None, attend_rows: int = 0
    ) -> None:
        self.owner = owner
        self.tokens = tokens
        self.graphs = graphs
        self.attend_rows = attend_rows

    def forward(
        self, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        o = self.owner
        o.attn.store(layer, positions, q, k, v, q_out=o.q_buf[: self.tokens])
        return self._break(layer)

    def forward_mla(self, layer: int, positions: torch.Tensor, parts: MlaParts, proj: MlaProjections) -> torch.Tensor:
        """Latent attention: entries written and the absorbed query put in the static buffer inside the graph;
        after the break W_UV maps the latent output back."""
        o = self.owner
        q_latent, q_pe = o.attn.store(layer, positions, parts, proj)  # type: ignore[call-arg]
        q = o.q_buf[: self.tokens]
        r = q_latent.shape[-1]
        q[..., :r].copy_(q_latent)
        q[..., r:].copy_(q_pe)
        return proj.values_from_latent(self._break(layer)[..., :r])

    def kv_write(self, layer: int, positions: torch.Tensor) -> KvWrite | None:
        return self.owner.attn.kv_write(layer, positions)  # the static write rows `_layers` set

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q rotated and K/V stored by the qkv GEMM: q into the static buffer the replay attends from."""
        self.owner.q_buf[: self.tokens].copy_(q)
        return self._break(layer)

    def _break(self, layer: int) -> torch.Tensor:
        o = self.owner
        if self.graphs is not None:
            self.graphs[-1].capture_end()
            self.graphs.append(torch.cuda.CUDAGraph())
            self.graphs[-1].capture_begin(pool=o.mempool)
        elif self.attend_rows:
            n = self.attend_rows
            o.attn.attend(layer, o.q_buf[:n], out=o.o_buf[:n])
        return o.o_buf[: self.tokens]


class StepGraphs:
    def __init__(
        self,
        model: DecoderModel,
        attn: FlashInferAttention | FlashInferMlaAttention,
        pool: KVPool,
        dummy_page: int,
        max_tokens: int,
        capture: bool = True,
    ) -> None:
        if model.tp.size > 1:
            raise ValueError("piecewise step graphs run one rank (tensor-parallel steps stay eager)")
        self.model = model
        self.attn = attn
        self.pool = pool
        self.dummy_page = dummy_page
        self.counts = graph_token_counts(max_tokens)
        self.max_tokens = self.counts[-1] if self.counts else 0
        cfg = model.cfg
        dev = model.device
        n = self.max_tokens
        self.inputs = GraphInputs.allocate(n, pool, dummy_page, dev)
        self.q_buf = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=model.dtype, device=dev)
        self.o_buf = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=model.dtype, device=dev)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=model.dtype, device=dev)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=model.dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.mempool = None
        self.capture_seconds = 0.0
        if capture and self.counts:
            self.capture()

    def pick(self, tokens: int) -> int:
        return smallest_fit(self.counts, tokens, "a step")

    def can_run(self, batch: ForwardBatch) -> bool:
        return 0 < batch.num_tokens <= self.max_tokens and bool(self.graphs)

    def _layers(self, tokens: int, graphs: list[torch.cuda.CUDAGraph] | None, attend_rows: int = 0) -> None:
        inp = self.inputs
        # Only the write rows: rebinding a wrapper would drop a split plan_extend made for the eager twin.
        self.attn.write_rows(inp.out_loc[:tokens])
        breaks = _BreakAtAttention(self, tokens, graphs, attend_rows)
        hidden, residual = self.model.forward_hidden(inp.input_ids[:tokens], inp.positions[:tokens], breaks)
        # Ops add a projection into the stream themselves at one row only; captured counts start at 16.
        assert isinstance(hidden, torch.Tensor)
        self.hidden[:tokens].copy_(hidden)
        self.residual[:tokens].copy_(residual)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        counts = sorted(self.counts, reverse=True)
        self.inputs.out_loc.fill_(self.inputs.dummy_slot)
        for n, tokens in enumerate(counts, 1):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._layers(tokens, None)  # warm-up outside the graphs (lazy inits, autotuning)
                torch.cuda.synchronize()
                graphs = [torch.cuda.CUDAGraph()]
                graphs[0].capture_begin(pool=self.mempool)
                try:
                    self._layers(tokens, graphs)
                finally:
                    graphs[-1].capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            self.graphs[tokens] = graphs
            log.debug("captured step graphs %d/%d (%d tokens, %d pieces)", n, len(counts), tokens, len(graphs))
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "captured step graphs for %d token counts up to %d in %.1f s",
            len(counts),
            self.max_tokens,
            self.capture_seconds,
        )

    def run(self, batch: ForwardBatch, replay: bool = True) -> torch.Tensor:
        """float32 logits of the rows at `batch.logits_indices`; `replay` False runs the pieces eagerly (a check)."""
        t = batch.num_tokens
        count = self.pick(t)
        self.inputs.load(batch, self.pool, count)
        attn = self.attn
        attn.plan_extend(attn.step_meta(batch), batch.extend_lens_cpu)
        if replay:
            graphs = self.graphs[count]
            q, o = self.q_buf[:t], self.o_buf[:t]
            graphs[0].replay()
            for layer, graph in enumerate(graphs[1:]):
                attn.attend(layer, q, out=o)
                graph.replay()
        else:
            self._layers(count, None, attend_rows=t)
        return self.model.final_logits(self.hidden[:t], self.residual[:t], batch.logits_indices)
