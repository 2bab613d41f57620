"""One file because one object plans every attention kernel of a step (FlashInfer's paged prefill and decode, the
Triton and XQA decodes) over the KV pool (docs/architecture.md, "GPU kernels" and "FP8"). The pool's `[L, 2, pages, page_size, H, D]` layout is
flashinfer's paged NHD layout per layer. The indptr/last-page vectors stay on the CPU (flashinfer's planner
reads them there: device tensors would cost a sync); the page ids are gathered on the device.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.fp8 import is_fp8, store_rows
from common.engine.gpu import fp8_kernels, xqa_decode
from common.engine.layers import KvWrite, RotaryCache
from common.engine.model_config import ModelConfig
from common.kv.pool import KVPool

log = logging.getLogger("kvferry.engine")

WORKSPACE_BYTES = 256 << 20
# Decode graphs up to this batch run the split-KV Triton kernel (common/engine/gpu/decode_attention.py);
# flashinfer's is as fast or faster above (bench/decode_kernels.py).
TRITON_DECODE_MAX_BS = 2
# FP8 pages: the same batches, 8 pages per tile (bench/decode_kernels.py --kv-dtypes fp8); XQA takes them on Hopper.
FP8_DECODE_TILE_PAGES = 8
# Mixed steps run their one-token rows on the decode kernel from this many rows (the prefill kernel gives each a
# whole query tile; bench/mixed_step.py --split-min-rows).
SPLIT_DECODE_MIN_ROWS = 1


def host_indptr(lens: list[int]) -> torch.Tensor:
    """A CSR row pointer over `lens` (int32, host): the query rows of a step's requests, as flashinfer plans them."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=out[1:])
    return out


def leading_single_token_rows(extend_lens: list[int]) -> int:
    n = 0
    for e in extend_lens:
        if e != 1:
            break
        n += 1
    return n


def fp8_prefill_supported(device: torch.device, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """flashinfer's FA3 FP8 prefill: Hopper, e4m3 pages, a head size its kernels are built for."""
    if device.type != "cuda" or kv_dtype != torch.float8_e4m3fn or head_dim not in (64, 128, 256):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def use_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """Tensor-core decode (flashinfer's prefill kernel on one query row) pays off from a GQA group of 4."""
    return num_heads // num_kv_heads >= 4


@dataclass
class PageMeta:
    indptr: torch.Tensor  # [B + 1] int32, CPU
    indices: torch.Tensor  # [nnz pages] int32, on the pool's device (the host's for latent attention's planner)
    last_page_len: torch.Tensor  # [B] int32, CPU

    def split(self, n: int) -> tuple[PageMeta, PageMeta]:
        cut = int(self.indptr[n])
        head = PageMeta(self.indptr[: n + 1], self.indices[:cut], self.last_page_len[:n])
        tail = PageMeta(self.indptr[n:] - cut, self.indices[cut:], self.last_page_len[n:])
        return head, tail

    def padded(self, bs: int, dummy_page: int) -> PageMeta:
        """Appends `bs - B` one-token requests on the dummy page (CUDA-graph padding)."""
        n = bs - int(self.last_page_len.shape[0])
        if n <= 0:
            return self
        extra = self.indptr[-1] + torch.arange(1, n + 1, dtype=torch.int32)
        dummy = torch.full((n,), dummy_page, dtype=torch.int32, device=self.indices.device)
        return PageMeta(
            indptr=torch.cat((self.indptr, extra)),
            indices=torch.cat((self.indices, dummy)),
            last_page_len=torch.cat((self.last_page_len, torch.ones(n, dtype=torch.int32))),
        )


# A decode graph's fixed device CSR buffers (indptr, page ids, last-page lengths): what its wrapper was built over
# and what the Triton and XQA decode kernels read.
GraphBuffers = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def page_meta(table: torch.Tensor, page_size: int, table_rows: torch.Tensor, seq_lens_cpu: list[int]) -> PageMeta:
    """flashinfer's CSR page description of a step's requests from the token-location table."""
    ps = page_size
    b = len(seq_lens_cpu)
    seq = torch.tensor(seq_lens_cpu, dtype=torch.int64)
    npages = (seq + ps - 1) // ps
    indptr = torch.zeros(b + 1, dtype=torch.int64)
    torch.cumsum(npages, 0, out=indptr[1:])
    last = seq - (npages - 1) * ps
    max_pages = int(npages.max())
    total = int(indptr[-1])
    # Flat entry e is page j of request r: at r * max_pages + j in the [B, max_pages] gathered block.
    owner = torch.repeat_interleave(torch.arange(b, dtype=torch.int64), npages, output_size=total)
    flat = owner * max_pages + torch.arange(total, dtype=torch.int64) - indptr[:-1][owner]
    firsts = table[:, : max_pages * ps : ps][table_rows].reshape(-1)
    dev_flat = flat.to(table.device, non_blocking=True)
    indices = torch.div(firsts[dev_flat], ps, rounding_mode="floor").to(torch.int32)
    return PageMeta(indptr.to(torch.int32), indices, last.to(torch.int32))


class PlanFences:
    """flashinfer stages a plan in pinned memory and copies it on the stream; re-planning a wrapper before that
    copy ran (the overlap loop plans step N+1 while N is queued) would overwrite it: one event per wrapper orders them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._planned: dict[int, torch.cuda.Event] = {}

    def before(self, wrapper: object) -> None:
        ev = self._planned.get(id(wrapper))
        if ev is not None:
            ev.synchronize()

    def after(self, wrapper: object) -> None:
        if not self.cuda:
            return
        ev = self._planned.get(id(wrapper))
        if ev is None:
            ev = self._planned[id(wrapper)] = torch.cuda.Event()
        ev.record()


class FlashInferAttention:
    """`AttentionBackend` over flashinfer: plan once per step, then `forward` per layer."""

    def __init__(
        self,
        pool: KVPool,
        page_table: torch.Tensor,
        cfg: ModelConfig,
        dtype: torch.dtype,
        workspace: torch.Tensor,
        rotary: RotaryCache,
        tc_min_batch: int = 1,
        triton_kernels: bool = True,
        pdl: bool = False,
    ) -> None:
        import flashinfer

        self.fi = flashinfer
        self.cos_sin = rotary.cos_sin()
        self.rope_store = None
        self.triton_decode = None
        self._triton_tile = None
        if triton_kernels:
            self._choose_triton(cfg, pool, pdl)
        self.num_sms = (
            torch.cuda.get_device_properties(pool.device).multi_processor_count if pool.device.type == "cuda" else 1
        )
        self._xqa_pages: xqa_decode.XqaPages | None = None  # a decode step (graph or eager) attends through XQA
        self.xqa = self._start_xqa(cfg, pool, page_table, dtype, pdl)
        # Set by `bind` for a CUDA-graph decode step on the Triton kernel: (indptr, indices, last, splits).
        self._triton_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
        self.pool = pool
        self.pdl = pdl  # programmatic dependent launches for the Triton kernels and XQA (common/engine/gpu/pdl.py)
        self.table = page_table
        self.page_size = pool.layout.page_size
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.dtype = dtype
        # FP8 pools: each layer's static scales, folded into the softmax scale and the output (None: not FP8).
        self.kv_dtype = pool.layout.dtype
        fp8 = is_fp8(self.kv_dtype)
        layout = pool.layout
        self.kv_scales = [(layout.kv_scale(i, 0), layout.kv_scale(i, 1)) for i in range(cfg.num_layers)]
        self.run_scales = [
            dict(k_scale=ks, v_scale=None if vs == 1.0 else vs) if fp8 else {} for ks, vs in self.kv_scales
        ]
        self.tensor_cores = use_tensor_cores(cfg.num_heads, cfg.num_kv_heads)
        self.tc_min_batch = max(1, tc_min_batch)
        self.workspace = workspace
        self.kv = [(pool.k_cache(i), pool.v_cache(i)) for i in range(cfg.num_layers)]
        self.rows = pool.rows
        self.k_offsets = [pool.layer_offset(i, 0) for i in range(cfg.num_layers)]
        self.v_offsets = [pool.layer_offset(i, 1) for i in range(cfg.num_layers)]
        # [2 * layers] row offsets (K, V per layer): the unfused write indexes the pool with one add a step.
        offsets = [o for kv in zip(self.k_offsets, self.v_offsets) for o in kv]
        self._kv_offsets = torch.tensor(offsets, dtype=torch.int64, device=pool.device)
        self._kv_rows: torch.Tensor | None = None
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.fp8_prefill = False  # prefill steps run FA3 with e4m3 queries (FP8 pools on Hopper)
        self.decode_wrappers = {tc: self.make_decode_wrapper(tensor_cores=tc) for tc in {self.tensor_cores, False}}
        self._wrapper = None
        # Set by plan_extend for a split step: (leading one-token rows, their planned decode wrapper).
        self._split: tuple[int, object] | None = None
        self._out_loc: torch.Tensor | None = None
        self.fences = PlanFences(workspace.device)
        if fp8_prefill_supported(pool.device, self.kv_dtype, cfg.head_dim):
            self._start_fp8_prefill()

    def _choose_triton(self, cfg: ModelConfig, pool: KVPool, pdl: bool) -> None:
        from common.engine.gpu import decode_attention, rope_store

        if rope_store.supports(cfg.head_dim):
            self.rope_store = functools.partial(rope_store.rope_store, launch_pdl=pdl)
        if decode_attention.supports(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, pool.layout.page_size):
            self.triton_decode = decode_attention
            pages = FP8_DECODE_TILE_PAGES if is_fp8(pool.layout.dtype) else decode_attention.PAGES_PER_TILE
            self._triton_tile = decode_attention.TileConfig(pages_per_tile=pages)

    @staticmethod
    def _start_xqa(
        cfg: ModelConfig, pool: KVPool, page_table: torch.Tensor, dtype: torch.dtype, pdl: bool
    ) -> xqa_decode.XqaDecode | None:
        if not xqa_decode.supported(pool.device, pool.layout.dtype, pool.layout.page_size, cfg.head_dim):
            return None
        pages = -(-page_table.shape[1] // pool.layout.page_size)
        try:
            xqa = xqa_decode.XqaDecode(pool.device, cfg.num_kv_heads, pool.layout.page_size, pages, pdl)
            xqa.probe(pool.k_cache(0), pool.v_cache(0), cfg.num_heads, dtype)
            return xqa
        except Exception as exc:  # a kernel that does not build here: flashinfer decodes the FP8 pages
            log.warning("XQA's FP8 decode kernel unavailable, flashinfer's runs: %s", str(exc)[:300])
            return None

    def _start_fp8_prefill(self) -> None:
        """FA3 over FP8 pages, probed with one token at start so a kernel that does not build here leaves FA2."""
        fa2 = self.prefill_wrapper
        self.prefill_wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa3")
        self.fp8_prefill = True
        try:
            page0 = torch.zeros(1, dtype=torch.int32, device=self.pool.device)
            one = torch.tensor([0, 1], dtype=torch.int32)
            self.plan_prefill(PageMeta(one, page0, one[1:]), [1])
            q = torch.zeros(1, self.num_heads, self.head_dim, dtype=self.dtype, device=self.pool.device)
            self.attend(0, q)
        except Exception as exc:  # a kernel that does not build here
            log.warning("FA3's FP8 prefill kernel unavailable, flashinfer's FA2 runs: %s", str(exc)[:300])
            self.prefill_wrapper = fa2
            self.fp8_prefill = False
        self._wrapper = None

    def decode_tensor_cores(self, batch_size: int) -> bool:
        return self.tensor_cores and batch_size >= self.tc_min_batch

    def make_decode_wrapper(self, graph_buffers: GraphBuffers | None = None, tensor_cores: bool = False):
        import flashinfer

        if graph_buffers is None:
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tensor_cores, backend="fa2"
            )
        indptr, indices, last = graph_buffers
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last,
            backend="fa2",
        )

    def page_meta(self, table_rows: torch.Tensor, seq_lens_cpu: list[int]) -> PageMeta:
        return page_meta(self.table, self.page_size, table_rows, seq_lens_cpu)

    def step_meta(self, batch: ForwardBatch) -> PageMeta:
        return self.page_meta(batch.table_rows, batch.seq_lens_cpu)

    def _before_plan(self, wrapper) -> None:
        self.fences.before(wrapper)

    def _after_plan(self, wrapper) -> None:
        self.fences.after(wrapper)

    def _xqa_view(self, meta: PageMeta) -> xqa_decode.XqaPages:
        dev = meta.indices.device
        width = int((meta.indptr[1:] - meta.indptr[:-1]).max())
        indptr, last = meta.indptr.to(dev, non_blocking=True), meta.last_page_len.to(dev, non_blocking=True)
        return self.xqa.pages(indptr, meta.indices, last, width)  # type: ignore[union-attr]

    def _pages_and_heads(self, meta: PageMeta) -> tuple[torch.Tensor | int, ...]:
        """The leading arguments of every flashinfer plan call: the page CSR, then the head and page shape."""
        indptr, indices, last = meta.indptr, meta.indices, meta.last_page_len
        return indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, self.page_size

    def plan_decode(self, wrapper, meta: PageMeta) -> None:
        self._before_plan(wrapper)
        wrapper.plan(
            *self._pages_and_heads(meta),
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
        )
        self._after_plan(wrapper)
        self._wrapper = wrapper
        self._split = None

    def plan_extend(self, meta: PageMeta, extend_lens_cpu: list[int]) -> None:
        """A prefill or mixed step: one prefill call, or the leading one-token rows on the decode kernel."""
        n = leading_single_token_rows(extend_lens_cpu)
        if not SPLIT_DECODE_MIN_ROWS <= n < len(extend_lens_cpu):
            self.plan_prefill(meta, extend_lens_cpu)
            return
        head, tail = meta.split(n)
        decode: object
        if self.xqa is not None:  # FP8 pages on Hopper: the rows attend as a decode graph's do
            decode = self._xqa_view(head)
        else:
            self.plan_decode(self.decode_wrappers[self.decode_tensor_cores(n)], head)
            decode = self._wrapper
        self.plan_prefill(tail, extend_lens_cpu[n:])
        self._split = (n, decode)

    def plan_prefill(self, meta: PageMeta, extend_lens_cpu: list[int]) -> None:
        self._triton_meta = None
        self._xqa_pages = None
        self._split = None
        w = self.prefill_wrapper
        qo = host_indptr(extend_lens_cpu)
        self._before_plan(w)
        w.plan(
            qo,
            *self._pages_and_heads(meta),
            causal=True,
            q_data_type=self.kv_dtype if self.fp8_prefill else self.dtype,
            kv_data_type=self.kv_dtype,
            o_data_type=self.dtype,
        )
        self._after_plan(w)
        self._wrapper = w

    def plan(self, batch: ForwardBatch) -> None:
        self._triton_meta = None
        self._xqa_pages = None
        meta = self.step_meta(batch)
        if batch.is_decode and self.xqa is not None:
            self._xqa_pages = self._xqa_view(meta)
            self._wrapper = self._split = None
        elif batch.is_decode:
            self.plan_decode(self.decode_wrappers[self.decode_tensor_cores(batch.batch_size)], meta)
        else:
            self.plan_extend(meta, batch.extend_lens_cpu)
        self._out_loc = self.pool.token_rows(batch.out_loc)  # pool rows of layer 0's K, once per step

    def bind(self, wrapper, out_loc: torch.Tensor, graph_meta: GraphBuffers | None = None) -> None:
        """Points forward() at a planned wrapper and a write-location buffer (CUDA-graph capture and replay);
        `graph_meta`: the device CSR buffers the wrapper (and the Triton decode kernel) reads."""
        self._wrapper = wrapper
        self._out_loc = out_loc
        self._triton_meta = None
        self._xqa_pages = None
        self._split = None
        if graph_meta is None:
            return
        bs = int(graph_meta[2].shape[0])
        if self.xqa is not None:
            self._xqa_pages = self.xqa.pages(*graph_meta)
        elif self.triton_decode is not None and bs <= TRITON_DECODE_MAX_BS:
            splits = self.triton_decode.num_splits(bs, self.num_kv_heads, self.num_sms)
            self._triton_meta = (*graph_meta, splits)

    def write_rows(self, out_loc: torch.Tensor) -> None:
        """Where `store` writes this step's K/V, the plan left as is (piecewise graphs capture `store`)."""
        self._out_loc = out_loc

    def forward(
        self, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (views are fine; each token's heads contiguous) -> [T, Hq, D]."""
        return self.attend(layer, self.store(layer, positions, q, k, v))

    def kv_write(self, layer: int, positions: torch.Tensor) -> KvWrite | None:
        """Where `store` would write: the qkv GEMV's epilogue writes there itself at a few rows (None: no Triton)."""
        if self.rope_store is None:
            return None
        assert self._out_loc is not None, "plan() or bind() must run before the layers"
        return KvWrite(
            positions,
            self.cos_sin,
            self.rows,
            self._out_loc,
            self.k_offsets[layer],
            self.v_offsets[layer],
            *self.kv_scales[layer],
        )

    def store(
        self,
        layer: int,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RoPE on q and k and the step's K/V written; returns the rotated q (piecewise graphs capture this half)."""
        loc = self._out_loc
        assert loc is not None, "plan() or bind() must run before the layers"
        ko, vo = self.k_offsets[layer], self.v_offsets[layer]
        if self.rope_store is not None:
            q_fp8 = self.fp8_prefill and q_out is None and self._split is None and self._wrapper is self.prefill_wrapper
            return self.rope_store(
                positions, q, k, v, self.cos_sin, self.rows, loc, ko, vo, q_out, *self.kv_scales[layer], q_fp8=q_fp8
            )
        if layer == 0:  # every layer's write rows at once (inside the graph when captured)
            self._kv_rows = self._kv_offsets[:, None] + loc[None, :]
        assert self._kv_rows is not None
        qr, kr = self.fi.apply_rope_with_cos_sin_cache(
            positions, q.flatten(1), k.flatten(1), q.shape[-1], self.cos_sin, True
        )
        ks, vs = self.kv_scales[layer]
        store_rows(self.rows, self._kv_rows[2 * layer], kr.view(k.shape), ks)
        store_rows(self.rows, self._kv_rows[2 * layer + 1], v, vs)
        if q_out is None:
            return qr.view(q.shape)
        return q_out.copy_(qr.view(q.shape))

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._xqa_pages is not None:
            return self.xqa.attend(q, *self.kv[layer], *self.kv_scales[layer], self._xqa_pages, out)  # type: ignore[union-attr]
        assert self._wrapper is not None, "plan() must run before forward()"
        if self._triton_meta is not None:
            indptr, indices, last, splits = self._triton_meta
            k_cache, v_cache = self.kv[layer]
            ks, vs = self.kv_scales[layer]
            return self.triton_decode.decode_attention(  # type: ignore[union-attr]
                q, k_cache, v_cache, indptr, indices, last, splits, ks, vs, self._triton_tile, self.pdl
            )
        if self._split is not None:
            n, decode = self._split
            out = torch.empty_like(q) if out is None else out
            if isinstance(decode, xqa_decode.XqaPages):
                self.xqa.attend(q[:n], *self.kv[layer], *self.kv_scales[layer], decode, out[:n])  # type: ignore[union-attr]
            else:
                decode.run(q[:n], self.kv[layer], out=out[:n], **self.run_scales[layer])  # type: ignore[attr-defined]
            self._run(self._wrapper, layer, q[n:], out[n:])
            return out
        return self._run(self._wrapper, layer, q, out)

    def _run(self, wrapper, layer: int, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if wrapper is self.prefill_wrapper and self.fp8_prefill:
            out = torch.empty(q.shape, dtype=self.dtype, device=q.device) if out is None else out
            q8 = q if is_fp8(q.dtype) else fp8_kernels.saturate(q)
            wrapper.run(q8, self.kv[layer], out=out, **self.run_scales[layer])
            return out
        return wrapper.run(q, self.kv[layer], out=out, **self.run_scales[layer])
