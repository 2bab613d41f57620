"""MLA on flashinfer: latent attention over the latent pool (docs/architecture.md, "Latent attention (MLA)").
Each layer's `ckv` / `kpe` operands are strided views of the pool (flashinfer reads the strides it is given), so
nothing is copied. Decode steps attend absorbed; prefill and mixed steps run the same absorbed kernel, causal,
except eager steps whose prompt chunks have no cached prefix: those rows attend decompressed (keys and values
expanded from this step's own latents through `kv_b_proj`, flashinfer's ragged prefill), a step's leading decode
rows absorbed beside them. Every plan is made outside any CUDA graph. Decode steps of a few requests run the
split-KV Triton kernel (common/engine/gpu/mla_decode.py) instead, over the same page CSR.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.fp8 import store_rows
from common.engine.gpu.attention import GraphBuffers, PageMeta, PlanFences, host_indptr, leading_single_token_rows
from common.engine.layers import RotaryCache
from common.engine.mla import LatentOnly, MlaParts, MlaProjections
from common.engine.model_config import ModelConfig
from common.kv.pool import KVPool

# flashinfer's MLA kernels tile queries by (token, head) rows, 64 per CTA: a tile edge inside a token's heads
# loses a visible key under the causal mask, so a token's heads must divide the tile (or be 128).
_TILE_ROWS = 64
# Decode steps up to this batch run the split-KV Triton kernel: flashinfer's MLA decode costs about the same per
# layer from batch 1 to 64 (bench/RESULTS.md, "Latent attention on flashinfer's MLA kernels"), too few programs per
# request to fill the chip; up to 16 requests the Triton kernel still gives each request several splits (its count
# chosen to fill the chip).
# `bench/mla.py --small-kernel on` times both kernels per batch to move this.
SPLIT_DECODE_MAX_BS = 16


def flashinfer_mla_unsupported(cfg: ModelConfig) -> str | None:
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
    """FA3 (Hopper) where it builds, else FA2."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return "fa3"
    return "fa2"


def host_page_meta(host_pages: np.ndarray, page_size: int, table_rows: np.ndarray, seq_lens_cpu: list[int]) -> PageMeta:
    """`PageMeta` of a step's requests built on the host, page ids included."""
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


def decompressed_rows_from(extend_lens: list[int], seq_lens: list[int]) -> int | None:
    """Where a prefill or mixed step's decompressed rows start (the leading one-token rows, decode, attend absorbed
    before them), or None: the whole step absorbed. Decompressed needs every later row to be a prompt chunk with no
    cached prefix (its KV length is its extend length), so its keys are this step's own latents and nothing is read
    back from the pool: the form that costs per query, not per cached token (docs/architecture.md)."""
    n = leading_single_token_rows(extend_lens)
    if n == len(extend_lens):
        return None
    if any(e != s for e, s in zip(extend_lens[n:], seq_lens[n:])):
        return None
    return n


@dataclass(frozen=True)
class SplitDecode:
    """A decode step on the split-KV Triton kernel: the device page CSR it reads (each request's KV length, as
    flashinfer's MLA plan takes it) and its split count; a decode graph's are its fixed buffers."""

    indptr: torch.Tensor
    indices: torch.Tensor
    kv_lens: torch.Tensor
    splits: int


def kv_lengths(meta: PageMeta, page_size: int) -> torch.Tensor:
    pages = meta.indptr[1:] - meta.indptr[:-1]
    return (pages - 1) * page_size + meta.last_page_len


class FlashInferMlaAttention(LatentOnly):
    """The `MlaBackend` of the GPU path: plan once per step, `forward_mla` per layer, with the planning and
    binding calls the decode and piecewise step graphs make on an attention backend. `split_decode_max_bs` > 0:
    decode steps (eager and captured) of up to that many requests on the split-KV Triton kernel, launched with
    PDL where `pdl`. `decompressed_prefill`: `plan` gives eager steps' no-prefix prompt chunks the decompressed
    form (`decompressed_rows_from`); the piecewise step graphs plan with `plan_extend`, absorbed, as their captured
    pieces compute the absorbed query and apply W_UV."""

    # GQA-path kernels latent attention does not use (the decode graphs and benchmarks read these).
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
        split_decode_max_bs: int = 0,
        pdl: bool = False,
        decompressed_prefill: bool = True,
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
        self.qk_head_dim = mla.qk_head_dim
        self.v_head_dim = mla.v_head_dim
        self.scale = mla.softmax_scale
        self.dtype = dtype
        self.rope = flashinfer.apply_rope_with_cos_sin_cache
        self.cos_sin = rotary.cos_sin()
        self.workspace = workspace
        self.fences = PlanFences(workspace.device)
        # Each layer's latent and roped-key parts: page-strided views of the pool.
        kv = pool.kv  # [pages, layers, 1, page_size, 1, latent_dim]
        self.ckv = [kv[:, i, 0, :, 0, : self.rank] for i in range(cfg.num_layers)]
        self.kpe = [kv[:, i, 0, :, 0, self.rank :] for i in range(cfg.num_layers)]
        self.offsets = [pool.layer_offset(i, 0) for i in range(cfg.num_layers)]
        self.eager_wrapper = self._wrapper_cls(workspace, backend=self.backend)
        self._wrapper = None
        self.decompressed_prefill = decompressed_prefill
        self.ragged_wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        # Set by `plan` for a step with decompressed rows: the first of them (rows before it absorbed); None: absorbed.
        self.decompressed_from: int | None = None
        self._out_loc: torch.Tensor | None = None
        self.pdl = pdl
        self.split_decode_max_bs = 0  # 0: flashinfer's kernel for every decode step
        self._split_decode = None
        if split_decode_max_bs > 0:
            from common.engine.gpu import mla_decode  # Triton: imported only where it is used

            if mla_decode.supports(self.rank, self.rope_dim, self.page_size):
                self._split_decode = mla_decode
                self._split_tile = mla_decode.default_tile(self.page_size)
                self._num_sms = torch.cuda.get_device_properties(pool.device).multi_processor_count
                self.split_decode_max_bs = split_decode_max_bs

    def step_meta(self, batch: ForwardBatch) -> PageMeta:
        """The step's pages from the table's host copy: flashinfer's MLA planner reads page ids on the host, and
        device ones would wait for the step in flight."""
        if batch.inputs is None:
            raise ValueError("a latent-attention step on flashinfer needs its StepInputs (build it with build_batch)")
        return host_page_meta(self.host_pages, self.page_size, batch.inputs.table_rows.numpy(), batch.seq_lens_cpu)

    def decode_tensor_cores(self, batch_size: int) -> bool:
        return False

    def make_decode_wrapper(self, graph_buffers: GraphBuffers | None = None, tensor_cores: bool = False):
        """A wrapper for eager steps, or one a decode graph captures over fixed buffers (its plans copy into them):
        at a batch the split-KV kernel takes, its `SplitDecode` over those buffers."""
        if graph_buffers is None:
            return self._wrapper_cls(self.workspace, backend=self.backend)
        indptr, indices, kv_lens = graph_buffers
        bs = int(kv_lens.shape[0])
        if bs <= self.split_decode_max_bs:
            return SplitDecode(indptr, indices, kv_lens, self._splits(bs))
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

    def _splits(self, batch: int) -> int:
        """Enough (request, head block, split) programs to fill the chip, fixed per batch (graphs capture the grid)."""
        assert self._split_decode is not None
        return self._split_decode.splits_for(batch, self.num_heads, self._num_sms)

    def _plan(self, wrapper, meta: PageMeta, qo_indptr: torch.Tensor, causal: bool) -> None:
        self.fences.before(wrapper)
        wrapper.plan(
            metadata=self._csr(qo_indptr, meta.indptr, meta.indices, kv_lengths(meta, self.page_size)),
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
        self.decompressed_from = None
        if isinstance(wrapper, SplitDecode):
            # The graph's buffers take the CSR directly (stream-ordered after the step that read them last); no
            # flashinfer plan, whose schedule the graph would not run.
            wrapper.indptr.copy_(meta.indptr, non_blocking=True)
            wrapper.indices[: meta.indices.numel()].copy_(meta.indices, non_blocking=True)
            wrapper.kv_lens.copy_(kv_lengths(meta, self.page_size), non_blocking=True)
            self._wrapper = wrapper
            return
        b = int(meta.last_page_len.shape[0])
        self._plan(wrapper, meta, torch.arange(b + 1, dtype=torch.int32), causal=False)

    def plan_extend(self, meta: PageMeta, extend_lens_cpu: list[int]) -> None:
        """A prefill or mixed step absorbed, in one causal call (a decode row sees its whole KV)."""
        self.decompressed_from = None
        self._plan(self.eager_wrapper, meta, host_indptr(extend_lens_cpu), causal=True)

    def plan_decompressed(self, meta: PageMeta, extend_lens_cpu: list[int], first: int) -> None:
        """Rows from `first` on decompressed (each row's keys are its own tokens: ragged, causal), the leading
        one-token rows before them absorbed on the decode plan."""
        if first:
            self.plan_decode(self.eager_wrapper, meta.split(first)[0])
        w = self.ragged_wrapper
        indptr = host_indptr(extend_lens_cpu[first:])
        self.fences.before(w)
        w.plan(
            indptr,
            indptr,
            self.num_heads,
            self.num_heads,
            self.qk_head_dim,
            head_dim_vo=self.v_head_dim,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.dtype,
        )
        self.fences.after(w)
        self.decompressed_from = first

    def plan(self, batch: ForwardBatch) -> None:
        meta = self.step_meta(batch)
        self.decompressed_from = None
        if batch.is_decode and batch.batch_size <= self.split_decode_max_bs:
            dev = self.pool.device
            lens = kv_lengths(meta, self.page_size)
            self._wrapper = SplitDecode(
                *(x.to(dev, non_blocking=True) for x in (meta.indptr, meta.indices, lens)),
                splits=self._splits(batch.batch_size),
            )
        elif batch.is_decode:
            self.plan_decode(self.eager_wrapper, meta)
        else:
            first = None
            if self.decompressed_prefill:
                first = decompressed_rows_from(batch.extend_lens_cpu, batch.seq_lens_cpu)
            if first is None:
                self.plan_extend(meta, batch.extend_lens_cpu)
            else:
                self.plan_decompressed(meta, batch.extend_lens_cpu, first)
        self._out_loc = self.pool.token_rows(batch.out_loc)

    def bind(self, wrapper, out_loc: torch.Tensor, graph_meta: GraphBuffers | None = None) -> None:
        """Points the layers at a planned wrapper and the step's write rows (graph capture)."""
        self._wrapper = wrapper
        self._out_loc = out_loc
        self.decompressed_from = None

    def write_rows(self, out_loc: torch.Tensor) -> None:
        self._out_loc = out_loc

    def store(
        self, layer: int, positions: torch.Tensor, parts: MlaParts, proj: MlaProjections
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q_pe and k_pe and this step's entries written; returns the absorbed query's two parts,
        W_UK^T q_nope and the roped q_pe."""
        q_pe, _ = self._rope_and_write(layer, positions, parts)
        return proj.absorb_query(parts.q_nope), q_pe

    def _rope_and_write(
        self, layer: int, positions: torch.Tensor, parts: MlaParts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q_pe and k_pe and this step's entries written: the roped q_pe `[T, H, rope]` and k_pe `[T, rope]`."""
        _, q_pe, latent, k_pe = parts
        loc = self._out_loc
        assert loc is not None, "plan() or bind() must run before the layers"
        t = q_pe.shape[0]
        # One kernel for both RoPE parts (k_pe read in place, a strided view of the merged projection).
        q_pe, k_pe = self.rope(positions, q_pe.reshape(t, -1), k_pe, self.rope_dim, self.cos_sin, True)
        entry = torch.cat((latent, k_pe), dim=-1).unsqueeze(1)  # [T, 1, latent_dim]
        store_rows(self.pool.rows, loc + self.offsets[layer], entry)
        return q_pe.view(t, -1, self.rope_dim), k_pe

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of a packed absorbed query as planned: each head's output in latent space (into the first
        `kv_lora_rank` values of `out` where given)."""
        r = self.rank
        return self._attend(layer, q[..., :r], q[..., r:], None if out is None else out[..., :r])

    def _attend(self, layer: int, q_latent: torch.Tensor, q_pe: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Without `out` the output lands head-major (`[H, T, rank]` seen as `[T, H, rank]`) for W_UV's batched GEMM."""
        w = self._wrapper
        assert w is not None, "plan() must run before the layers"
        if out is None:
            t, h, r = q_latent.shape
            out = q_latent.new_empty(h, t, r).transpose(0, 1)
        if isinstance(w, SplitDecode):
            assert self._split_decode is not None
            ckv, kpe = self.ckv[layer], self.kpe[layer]
            return self._split_decode.mla_decode(
                q_latent,
                q_pe,
                ckv,
                kpe,
                w.indptr,
                w.indices,
                w.kv_lens,
                w.splits,
                self.scale,
                out,
                self._split_tile,
                self.pdl,
            )
        return self._wrapper.run(query=(q_latent, q_pe), kv_cache=(self.ckv[layer], self.kpe[layer]), out=out)

    def attend_decompressed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, proj: MlaProjections
    ) -> torch.Tensor:
        """Rows planned by `plan_decompressed` (from its `first` on), RoPE applied: each head's key [W_UK_h c | k_pe]
        and value W_UV_h c from this step's latents, then the ragged causal prefill: `[T, H, v_head_dim]`."""
        k_nope, v = proj.expand(latent)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
        return self.ragged_wrapper.run(torch.cat((q_nope, q_pe), dim=-1), k, v)

    def forward_mla(self, layer: int, positions: torch.Tensor, parts: MlaParts, proj: MlaProjections) -> torch.Tensor:
        q_pe, k_pe = self._rope_and_write(layer, positions, parts)
        q_nope, first = parts.q_nope, self.decompressed_from
        if first is None:
            return proj.values_from_latent(self._attend(layer, proj.absorb_query(q_nope), q_pe, None))
        tail = self.attend_decompressed(q_nope[first:], q_pe[first:], parts.latent[first:], k_pe[first:], proj)
        if not first:
            return tail
        head = self._attend(layer, proj.absorb_query(q_nope[:first]), q_pe[:first], None)
        return torch.cat((proj.values_from_latent(head), tail))
