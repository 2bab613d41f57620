"""MLA on flashinfer: the absorbed form of latent attention over the latent pool, for every kind of step.

flashinfer's `BatchMLAPagedAttentionWrapper` attends queries in latent space, q' = [W_UK^T q_nope | q_pe], over
paged entries [latent (kv_lora_rank) | roped key (qk_rope_head_dim)] shared by every head, and returns each head's
output in latent space; W_UV maps it back (common/engine/mla.py). The pool holds exactly those entries, one row of
`latent_dim` per token and layer, so each layer's `ckv` / `kpe` operands are views of it (`[pages, page_size,
kv_lora_rank]` and `[pages, page_size, rope]` with the pool's page stride): flashinfer's FA2/FA3 MLA kernels read
the page and token strides they are given (16-byte aligned, last dim contiguous), so nothing is copied and the
pool's one layout keeps serving NIXL and the host tier.

Prefill and mixed steps run the same absorbed kernel, causal (each request's queries aligned with the end of its
KV, which is chunked prefill and prefix hits), as SGLang does for short prefixes. The decompressed form would
expand every cached latent through `kv_b_proj` per layer and run a second kernel family (head dim 192 / 128),
which flashinfer's MLA wrapper does not cover; the absorbed form costs `heads * kv_lora_rank` wider dot products
instead, which for the prompt lengths P/D prefill pods serve (up to a few thousand tokens) keeps one code path
and one plan per step. A step's plan is made outside any CUDA graph: decode graphs replay a wrapper planned into
fixed metadata buffers, and the piecewise step graphs break at each layer's attention, as the GQA path's do.
"""

from __future__ import annotations

import numpy as np
import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.fp8 import store_rows
from common.engine.gpu.attention import PageMeta, PlanFences
from common.engine.layers import KvWrite, RotaryCache
from common.engine.mla import MlaProjections
from common.engine.model_config import ModelConfig
from common.kv.pool import KVPool

# flashinfer's MLA kernels tile queries by (token, head) rows, 64 per CTA (128 per cluster of two); a tile edge that
# falls inside a token's heads loses a visible key under the causal mask (flashinfer refuses such plans), so the
# heads of a token must divide the tile: 1-64 heads that divide 64, or 128 (clusters of two from 64 rows on).
_TILE_ROWS = 64


def flashinfer_mla_unsupported(cfg: ModelConfig) -> str | None:
    """Why this model's latent attention cannot run on flashinfer's MLA kernels; None where it can."""
    mla = cfg.mla
    if mla is None:
        return "the model has no latent attention"
    if mla.kv_lora_rank % 128 or mla.qk_rope_head_dim % 64 or mla.qk_rope_head_dim == 0:
        return (
            f"flashinfer's MLA kernels need kv_lora_rank a multiple of 128 and qk_rope_head_dim a multiple of 64, "
            f"not {mla.kv_lora_rank} and {mla.qk_rope_head_dim}"
        )
    h = cfg.num_heads
    if _TILE_ROWS % h and h != 2 * _TILE_ROWS:
        return f"flashinfer's MLA kernels tile 64 query rows of (token, head): {h} heads do not divide a tile"
    return None


def mla_backend_name(device: torch.device) -> str:
    """FA3 (Hopper's warp-specialised kernel) where it builds, else FA2."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return "fa3"
    return "fa2"


def host_page_meta(host_pages: np.ndarray, page_size: int, table_rows: np.ndarray, seq_lens_cpu: list[int]) -> PageMeta:
    """`PageMeta` of a step's requests (table rows `table_rows`) built on the host, page ids included."""
    seq = np.asarray(seq_lens_cpu, dtype=np.int64)
    npages = (seq + page_size - 1) // page_size
    indptr = np.zeros(len(seq) + 1, dtype=np.int64)
    np.cumsum(npages, out=indptr[1:])
    owner = np.repeat(np.arange(len(seq)), npages)
    indices = host_pages[table_rows[owner], np.arange(int(indptr[-1])) - indptr[:-1][owner]]
    last = seq - (npages - 1) * page_size
    return PageMeta(
        torch.from_numpy(indptr.astype(np.int32)), torch.from_numpy(indices), torch.from_numpy(last.astype(np.int32))
    )


class FlashInferMlaAttention:
    """The `MlaBackend` of the GPU path: plan once per step, `forward_mla` per layer. It offers what the decode graphs
    (common/engine/gpu/cuda_graph.py) and the piecewise step graphs (common/engine/gpu/step_graphs.py) call on an
    attention backend: `step_meta`, `make_decode_wrapper`, `plan_decode`, `plan_extend`, `bind`, `write_rows`,
    `store` and `attend`. `host_pages` is the page table's host copy (`PageTable.host_pages`)."""

    # Kernels of the GQA path that latent attention does not use (the decode graphs and benchmarks read these).
    xqa = None
    triton_decode = None
    rope_store = None
    fp8_prefill = False
    tensor_cores = False
    tc_min_batch = 1

    def __init__(
        self,
        pool: KVPool,
        host_pages: np.ndarray,
        cfg: ModelConfig,
        dtype: torch.dtype,
        workspace: torch.Tensor,
        rotary: RotaryCache,
    ) -> None:
        import flashinfer
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        why = flashinfer_mla_unsupported(cfg)
        if why is not None:
            raise ValueError(f"{cfg.model_type}: {why}")
        mla = cfg.mla
        assert mla is not None
        layout = pool.layout
        if layout.kv_parts != 1 or layout.head_dim != mla.latent_dim or layout.dtype != dtype:
            raise ValueError(
                f"flashinfer's MLA needs a {dtype} latent pool of {mla.latent_dim} per token, not {layout}"
            )
        self._wrapper_cls = BatchMLAPagedAttentionWrapper
        self._csr = MLAPlanMetadata.csr
        self.backend = mla_backend_name(pool.device)
        self.pool = pool
        self.host_pages = host_pages
        self.page_size = layout.page_size
        self.num_heads = cfg.num_heads
        self.rank = mla.kv_lora_rank
        self.rope_dim = mla.qk_rope_head_dim
        self.scale = mla.softmax_scale
        self.dtype = dtype
        self.rope = flashinfer.apply_rope_with_cos_sin_cache
        self.cos_sin = rotary.cos_sin()
        self.workspace = workspace
        self.fences = PlanFences(workspace.device)
        # Each layer's latent and roped-key parts: views of the pool ([pages, page_size, width], page-strided).
        kv = pool.kv  # [pages, layers, 1, page_size, 1, latent_dim]
        self.ckv = [kv[:, i, 0, :, 0, : self.rank] for i in range(cfg.num_layers)]
        self.kpe = [kv[:, i, 0, :, 0, self.rank :] for i in range(cfg.num_layers)]
        self.offsets = [pool.layer_offset(i, 0) for i in range(cfg.num_layers)]
        self.eager_wrapper = self._wrapper_cls(workspace, backend=self.backend)
        self._wrapper = None
        self._out_loc: torch.Tensor | None = None

    # ---- planning (outside any graph) ---------------------------------------------------------------
    def step_meta(self, batch: ForwardBatch) -> PageMeta:
        """The step's pages from the host copy of the table (`PageTable.host_pages`): flashinfer's MLA planner reads
        the page ids on the host, and handing it device ones would wait there for the step in flight."""
        if batch.inputs is None:
            raise ValueError("a latent-attention step on flashinfer needs its StepInputs (build it with build_batch)")
        return host_page_meta(self.host_pages, self.page_size, batch.inputs.table_rows.numpy(), batch.seq_lens_cpu)

    def decode_tensor_cores(self, batch_size: int) -> bool:
        return False

    def make_decode_wrapper(
        self, graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, tensor_cores: bool = False
    ):
        """A wrapper for eager steps, or one a decode graph captures over the fixed buffers (indptr `[bs + 1]`,
        page ids, and `[bs]` that holds the KV lengths here): its plans copy the metadata into them."""
        if graph_buffers is None:
            return self._wrapper_cls(self.workspace, backend=self.backend)
        indptr, indices, kv_lens = graph_buffers
        bs = int(kv_lens.shape[0])
        qo = torch.arange(bs + 1, dtype=torch.int32, device=indptr.device)  # one query per request
        return self._wrapper_cls(
            self.workspace,
            use_cuda_graph=True,
            qo_indptr=qo,
            kv_indptr=indptr,
            kv_indices=indices,
            kv_len_arr=kv_lens,
            backend=self.backend,
        )

    def _plan(self, wrapper, meta: PageMeta, qo_indptr: torch.Tensor, causal: bool) -> None:
        pages = meta.indptr[1:] - meta.indptr[:-1]
        kv_lens = (pages - 1) * self.page_size + meta.last_page_len
        self.fences.before(wrapper)
        wrapper.plan(
            metadata=self._csr(qo_indptr, meta.indptr, meta.indices, kv_lens),
            num_heads=self.num_heads,
            head_dim_ckv=self.rank,
            head_dim_kpe=self.rope_dim,
            page_size=self.page_size,
            causal=causal,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            query_layout="split",
            kv_cache_layout="split",
        )
        self.fences.after(wrapper)
        self._wrapper = wrapper

    def plan_decode(self, wrapper, meta: PageMeta) -> None:
        b = int(meta.last_page_len.shape[0])
        self._plan(wrapper, meta, torch.arange(b + 1, dtype=torch.int32), causal=False)

    def plan_extend(self, meta: PageMeta, extend_lens_cpu: list[int]) -> None:
        """A prefill or mixed step in one causal call: a decode row (one query) sees its whole KV under it."""
        qo = torch.zeros(len(extend_lens_cpu) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(extend_lens_cpu, dtype=torch.int32), 0, out=qo[1:])
        self._plan(self.eager_wrapper, meta, qo, causal=True)

    def plan(self, batch: ForwardBatch) -> None:
        meta = self.step_meta(batch)
        if batch.is_decode:
            self.plan_decode(self.eager_wrapper, meta)
        else:
            self.plan_extend(meta, batch.extend_lens_cpu)
        self._out_loc = self.pool.token_rows(batch.out_loc)

    def bind(
        self,
        wrapper,
        out_loc: torch.Tensor,
        graph_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Points the layers at a planned wrapper and the step's write rows (KVPool.token_rows): graph capture."""
        self._wrapper = wrapper
        self._out_loc = out_loc

    def write_rows(self, out_loc: torch.Tensor) -> None:
        self._out_loc = out_loc

    # ---- per layer --------------------------------------------------------------------------------
    def forward(
        self, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        raise TypeError("latent attention layers call forward_mla")

    def kv_write(self, layer: int, positions: torch.Tensor) -> KvWrite | None:
        return None  # the entry is [normed latent | roped k_pe]: not a qkv GEMM's output

    def store(
        self,
        layer: int,
        positions: torch.Tensor,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        proj: MlaProjections,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q_pe and k_pe, this step's [latent | k_pe] entries written at the step's rows; returns the
        absorbed query's two parts, W_UK^T q_nope `[T, H, kv_lora_rank]` and the roped q_pe `[T, H, rope]`."""
        loc = self._out_loc
        assert loc is not None, "plan() or bind() must run before the layers"
        t = q_pe.shape[0]
        # One kernel for both RoPE parts (k_pe is read in place, a strided view of the merged projection).
        q_pe, k_pe = self.rope(positions, q_pe.reshape(t, -1), k_pe, self.rope_dim, self.cos_sin, True)
        entry = torch.cat((latent, k_pe), dim=-1).unsqueeze(1)  # [T, 1, latent_dim]
        store_rows(self.pool.rows, loc + self.offsets[layer], entry)
        return proj.absorb_query(q_nope), q_pe.view(t, -1, self.rope_dim)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of a packed absorbed query `[T, H, kv_lora_rank + rope]` (the step graphs' static buffer) as
        planned: each head's output in latent space, `[T, H, kv_lora_rank]` (`out`'s first `kv_lora_rank` values
        where given, which may be as wide as q)."""
        r = self.rank
        return self._attend(layer, q[..., :r], q[..., r:], None if out is None else out[..., :r])

    def _attend(self, layer: int, q_latent: torch.Tensor, q_pe: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """flashinfer reads q and writes the output at the strides it is given. Without `out` the output lands
        head-major (`[H, T, rank]` seen as `[T, H, rank]`), the layout W_UV's batched GEMM reads."""
        assert self._wrapper is not None, "plan() must run before the layers"
        if out is None:
            t, h, r = q_latent.shape
            out = q_latent.new_empty(h, t, r).transpose(0, 1)
        return self._wrapper.run(query=(q_latent, q_pe), kv_cache=(self.ckv[layer], self.kpe[layer]), out=out)

    def forward_mla(
        self,
        layer: int,
        positions: torch.Tensor,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        proj: MlaProjections,
    ) -> torch.Tensor:
        q_latent, q_pe = self.store(layer, positions, q_nope, q_pe, latent, k_pe, proj)
        return proj.values_from_latent(self._attend(layer, q_latent, q_pe, None))
