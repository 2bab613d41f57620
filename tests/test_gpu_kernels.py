"""The Triton kernels of the GPU path against float64 references, on fresh random inputs with poisoned outputs.

GPU-only (they skip without CUDA); on the CPU the same contract is the model's `TorchOps`, which every engine
test runs.
"""

from __future__ import annotations

import pytest
import torch

from tests.gemv_reference import rel_err, rms_norm64, silu_mul64, weight_operand
from tests.paged_reference import attention_float64, csr_lengths, mla_attention_float64

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.skipif(not CUDA, reason="needs a CUDA device"), pytest.mark.gpu]


def _reference(prologue: str, x, weight, bias, residual, norm_weight, eps):
    new_res = None
    if prologue == "silu":
        a = silu_mul64(x)
    elif prologue in ("norm", "add_norm"):
        s = x
        if prologue == "add_norm":
            new_res = s = (x.float() + residual.float()).to(x.dtype)
        a = rms_norm64(s, norm_weight, eps)
    else:
        a = x.double()
    y = a @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y, new_res


@pytest.mark.parametrize("prologue", ["none", "norm", "add_norm", "silu"])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("n,k", [(96, 256), (1000, 1536), (20000, 4096)])
def test_gemv_matches_float64(prologue, rows, n, k):
    from common.engine.gpu.fused_gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(rows * 7919 + n + k)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)

    width = 2 * k if prologue == "silu" else k
    x, weight = randn(rows, width), randn(n, k, scale=k**-0.5)
    bias = randn(n) if prologue == "norm" else None  # qkv projections with bias take the norm prologue
    residual = randn(rows, k) if prologue == "add_norm" else None
    norm_weight = (1.0 + 0.2 * torch.randn(k, generator=g, device="cuda")).to(torch.bfloat16)
    y, new_res = gemv(x, weight, bias, prologue=prologue, residual=residual, norm_weight=norm_weight, eps=1e-5)
    ref, ref_res = _reference(prologue, x, weight, bias, residual, norm_weight, 1e-5)
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) < 8e-3  # bf16 operands, float32 accumulation
    if prologue == "add_norm":
        assert new_res is not None and torch.equal(new_res, ref_res)
    else:
        assert new_res is None
    # The inputs are read, never written.
    assert torch.isfinite(x).all()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_gemv_into_the_stream_then_its_norm_from_the_statistics(fp8, silu, rows):
    """An output projection adding into the residual stream (its epilogue: stream += y, and the stream's
    sum-of-squares partials), then the next GEMV applying RMSNorm from those partials: the stream is what the add
    writes in 16 bits, the partials sum to its rows' sums of squares, and the second GEMV is the normed product,
    also read as the MLP's [gate; up] with SiLU-mul in its epilogue."""
    from common.engine.gpu.fused_gemv import gemv

    hidden, inner, wide, eps = 4096, 1536, 12000, 1e-5
    g = torch.Generator(device="cuda").manual_seed(rows * 17 + fp8 * 3 + silu)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)

    x = randn(rows, 2 * inner if silu else inner)
    w_out, out_scale, dense_out = weight_operand(randn(hidden, inner, scale=inner**-0.5), fp8)
    w_next, next_scale, dense_next = weight_operand(randn(wide, hidden, scale=hidden**-0.5), fp8)
    stream = randn(rows, hidden)
    before = stream.double()
    norm_weight = (1.0 + 0.2 * torch.randn(hidden, generator=g, device="cuda")).to(torch.bfloat16)

    new, sumsq = gemv(
        x, w_out, prologue="silu" if silu else "none", weight_scale=out_scale, into_stream=stream, launch_pdl=False
    )
    assert new.data_ptr() == stream.data_ptr()  # in place, as flashinfer's add + RMSNorm updates it
    added = (silu_mul64(x) if silu else x.double()) @ dense_out.T
    assert rel_err(stream.double() - before, added) < 1.5e-2  # the add rounds to 16 bits
    assert sumsq.dtype == torch.float32 and sumsq.shape[0] == rows
    torch.testing.assert_close(sumsq.double().sum(1), stream.double().pow(2).sum(1), rtol=1e-5, atol=0)

    y, act = (
        gemv(
            stream,
            w_next,
            prologue="stream_norm",
            norm_weight=norm_weight,
            eps=eps,
            norm_stats=sumsq,
            weight_scale=next_scale,
            gated=gated,
        )[0]
        for gated in (False, True)
    )
    ref_y = rms_norm64(stream, norm_weight, eps) @ dense_next.T
    assert y.shape == (rows, wide) and torch.isfinite(y).all()
    assert rel_err(y, ref_y) < 8e-3
    assert act.shape == (rows, wide // 2) and torch.isfinite(act).all()
    assert rel_err(act, silu_mul64(ref_y)) < 1e-2


def test_gemv_writes_every_output_and_nothing_else():
    """Outputs come from fresh buffers; run it twice on new inputs: no stale value survives (poisoned x)."""
    from common.engine.gpu.fused_gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(5)
    weight = torch.randn(777, 512, generator=g, device="cuda").to(torch.bfloat16) * 0.04
    for rows in (1, 3):
        for _ in range(2):
            x = torch.randn(rows, 512, generator=g, device="cuda").to(torch.bfloat16)
            y, _ = gemv(x, weight)
            assert rel_err(y, x.double() @ weight.double().T) < 8e-3


@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_as_a_dependent_launch_computes_the_same(fp8):
    """Launched with PDL, right after a kernel that writes its input: the same bytes out as a plain launch."""
    from common.engine import fp8 as fp8_mod
    from common.engine.gpu.fused_gemv import gemv
    from common.engine.gpu.path import pdl_available

    if not pdl_available(torch.device("cuda"), triton=True):
        pytest.skip("needs compute capability 9.0 and a Triton with launch_pdl")
    g = torch.Generator(device="cuda").manual_seed(17)
    weight = torch.randn(1000, 1536, generator=g, device="cuda").to(torch.bfloat16) * 0.03
    scale = None
    if fp8:
        weight, scale = fp8_mod.quantize_rows(weight)
        scale = scale.view(-1)
    for rows in (1, 5):
        src = torch.randn(rows, 1536, generator=g, device="cuda").to(torch.bfloat16)
        plain, _ = gemv(src * 2, weight, weight_scale=scale)
        for _ in range(3):
            x = src * 2  # written by the kernel just before: the GEMV must wait for it
            y, _ = gemv(x, weight, weight_scale=scale, launch_pdl=True)
            assert torch.equal(y, plain)


def test_gemv_refuses_what_it_cannot_serve():
    from common.engine.gpu.fused_gemv import MAX_ROWS, gemv

    w = torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError):
        gemv(torch.zeros(MAX_ROWS + 1, 128, dtype=torch.bfloat16, device="cuda"), w)
    with pytest.raises(ValueError):
        gemv(torch.zeros(1, 100, dtype=torch.bfloat16, device="cuda"), w)
    with pytest.raises(ValueError):
        gemv(torch.zeros(1, 128, dtype=torch.bfloat16, device="cuda"), w, prologue="silu")


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (4, 2, 128), (4, 1, 64)])
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_attention_matches_float64(hq, hkv, d, splits, fp8):
    """Split-KV decode over shuffled pages, lengths with partial last pages (1 token, one page + 1, long);
    bf16 pages, or e4m3 pages with K/V scales (the reference reads the same stored values times the scales)."""
    from common.engine.gpu.decode_attention import decode_attention

    g = torch.Generator(device="cuda").manual_seed(hq * 31 + splits)
    ps, pages = 16, 400
    lens = [1, 17, 300, 1000, 64]
    ks, vs = (0.5, 0.25) if fp8 else (1.0, 1.0)
    kv = torch.randn(pages, 3, 2, ps, hkv, d, generator=g, device="cuda")
    kv = kv.to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    layer = 1
    k_cache, v_cache = kv[:, layer, 0], kv[:, layer, 1]
    perm = torch.randperm(pages, generator=g, device="cuda")
    total, indptr, last = csr_lengths(lens, ps, "cuda")
    indices = perm[:total].to(torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g, device="cuda").to(torch.bfloat16)
    out = decode_attention(q, k_cache, v_cache, indptr, indices, last, splits, ks, vs)
    for i, ref in enumerate(attention_float64(q, k_cache, v_cache, indptr, indices, lens, ks, vs)):
        assert torch.isfinite(out[i]).all()
        assert rel_err(out[i], ref) < 1e-2, (i, lens[i])


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64)])  # llama-3.1-8b's heads, SmolLM2-135M's
def test_xqa_decode_over_fp8_pages_matches_float64(hq, hkv, d):
    """XQA's FP8 kernel (Hopper) over shuffled e4m3 pages with distinct K and V scales, lengths with partial last
    pages, its page table and lengths derived from the CSR buffers a decode graph holds (padded past the rows);
    its Q is quantized to e4m3 too, hence a looser bound than the 16-bit kernels'."""
    from common.engine.gpu import xqa_decode

    ps, pages, dtype = 16, 400, torch.float8_e4m3fn
    if not xqa_decode.supported(torch.device("cuda"), dtype, ps, d):
        pytest.skip("XQA's FP8 kernel needs Hopper")
    g = torch.Generator(device="cuda").manual_seed(hq + d)
    lens = [1, 17, 300, 1000, 64]
    ks, vs = 0.5, 0.25
    kv = torch.randn(pages, 3, 2, ps, hkv, d, generator=g, device="cuda").to(dtype)
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    perm = torch.randperm(pages, generator=g, device="cuda")
    total, indptr, last = csr_lengths(lens, ps, "cuda")
    indices = torch.zeros(len(lens) * 64 + 8, dtype=torch.int32, device="cuda")  # a graph's buffer: longer
    indices[:total] = perm[:total].to(torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g, device="cuda").to(torch.bfloat16)
    xqa = xqa_decode.XqaDecode(torch.device("cuda"), hkv, ps, pages_per_seq=64)
    out = xqa.attend(q, k_cache, v_cache, ks, vs, xqa.pages(indptr, indices, last))
    # An eager step's pages (its decode rows known): the table only as wide as its longest row.
    eager = xqa.attend(q, k_cache, v_cache, ks, vs, xqa.pages(indptr, indices, last, width=-(-1000 // ps)))
    assert torch.equal(eager, out)
    for i, ref in enumerate(attention_float64(q, k_cache, v_cache, indptr, indices, lens, ks, vs)):
        assert torch.isfinite(out[i]).all()
        assert rel_err(out[i], ref) < 5e-2, (i, lens[i], rel_err(out[i], ref))


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_mla_split_decode_matches_flashinfer_mla_and_float64(batch):
    """DeepSeek-V2-Lite's latent attention (16 heads, kv_lora_rank 512, RoPE 64, 16-token pages, bf16) over strided
    layer views of a latent pool, shuffled pages, ragged lengths (one token, partial last pages, shorter than a
    split, long): the split-KV Triton kernel at the path's split count, into a head-major buffer as the layer reads
    it, against float64 and against flashinfer's MLA kernel planned as common/engine/gpu/mla_attention.py plans it."""
    pytest.importorskip("flashinfer")
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    from common.engine.gpu.attention import PageMeta
    from common.engine.gpu.mla_attention import kv_lengths, mla_backend_name
    from common.engine.gpu.mla_decode import mla_decode, splits_for

    heads, rank, rope, ps, pages = 16, 512, 64, 16, 1600
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(batch)
    lens = ([1500, 17, 300, 1] + torch.randint(1, 1500, (batch,), generator=g, device="cuda").tolist())[:batch]
    kv = torch.randn(pages, 2, 1, ps, 1, rank + rope, generator=g, device="cuda").to(torch.bfloat16)
    ckv, kpe = kv[:, 1, 0, :, 0, :rank], kv[:, 1, 0, :, 0, rank:]
    total, indptr, last = csr_lengths(lens, ps, "cpu")
    indices = torch.randperm(pages, generator=g, device="cuda")[:total].to(torch.int32)
    q = torch.randn(batch, heads, rank + rope, generator=g, device="cuda").to(torch.bfloat16)
    q_nope, q_pe = q[..., :rank], q[..., rank:]
    scale = (128 + rope) ** -0.5
    kv_lens = kv_lengths(PageMeta(indptr, indices.cpu(), last), ps)
    splits = splits_for(batch, heads, torch.cuda.get_device_properties(dev).multi_processor_count)
    out = torch.full((heads, batch, rank), float("nan"), dtype=torch.bfloat16, device=dev).transpose(0, 1)
    got = mla_decode(q_nope, q_pe, ckv, kpe, indptr.to(dev), indices, kv_lens.to(dev), splits, scale, out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()

    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = BatchMLAPagedAttentionWrapper(workspace, backend=mla_backend_name(dev))
    wrapper.plan(
        metadata=MLAPlanMetadata.csr(torch.arange(batch + 1, dtype=torch.int32), indptr, indices.cpu(), kv_lens),
        num_heads=heads,
        head_dim_ckv=rank,
        head_dim_kpe=rope,
        page_size=ps,
        causal=False,
        sm_scale=scale,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        query_layout="split",
        kv_cache_layout="split",
    )
    flashinfer_out = wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe))
    refs = mla_attention_float64(q_nope, q_pe, ckv, kpe, indptr, indices, lens, scale)
    for i, ref in enumerate(refs):
        mine, theirs = rel_err(out[i], ref), rel_err(flashinfer_out[i], ref)
        assert mine < 1e-2 and mine < 1.5 * theirs + 2e-3, (i, lens[i], mine, theirs)
        assert rel_err(out[i], flashinfer_out[i].double()) < 2e-2, (i, lens[i])


@pytest.mark.parametrize("rows", [1, 5, 16, 64, 300])
@pytest.mark.parametrize("n,k", [(96, 256), (6144, 4096), (4096, 14336)])
def test_fp8_gemms_match_float64_of_their_operands(rows, n, k):
    """FP8 weights (one scale per output channel): the GEMV (up to 16 rows, 16-bit activations) and the
    scaled tensor-core GEMM (per-token activation scales) against float64 over the same quantized operands."""
    from common.engine.fp8 import Fp8Linear, quantize_rows
    from common.engine.gpu.fp8_gemm import fp8_linear
    from common.engine.gpu.fp8_quant import quantize_rows as quantize_rows_triton
    from common.engine.gpu.fused_gemv import MAX_ROWS, gemv

    g = torch.Generator(device="cuda").manual_seed(rows * 131 + n + k)
    x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
    wq, ws = quantize_rows(torch.randn(n, k, generator=g, device="cuda") * k**-0.5)
    w = Fp8Linear(wq, ws.flatten())
    dense = wq.double() * ws.double()
    # The Triton activation quantizer writes what torch's does (round to nearest even, the same scales).
    xq, sx = quantize_rows_triton(x)
    xq_ref, sx_ref = quantize_rows(x)
    torch.testing.assert_close(sx, sx_ref)
    assert (xq.view(torch.uint8) != xq_ref.view(torch.uint8)).float().mean() < 1e-3  # ties may round apart
    y = fp8_linear(x, w)
    ref = (xq_ref.double() * sx_ref.double()) @ dense.T
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert rel_err(y, ref) < 8e-3
    assert rel_err(y, x.double() @ dense.T) < 6e-2  # what per-token e4m3 activations cost
    if rows <= MAX_ROWS:
        yv, _ = gemv(x, wq, weight_scale=w.scale)
        assert rel_err(yv, x.double() @ dense.T) < 8e-3


def test_rope_store_writes_fp8_pages_as_torch_rounds_them():
    from common.engine.fp8 import to_fp8
    from common.engine.gpu.rope_store import rope_store
    from common.engine.layers import RotaryCache
    from common.engine.model_config import RopeConfig

    t, hq, hkv, d = 37, 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    rc = RotaryCache.build(d, RopeConfig(), 4096, torch.device("cuda"))
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g, device="cuda").to(torch.bfloat16) * 4
    q, k, v = (p.view(t, -1, d) for p in qkv.split((hq * d, hkv * d, hkv * d), -1))
    pos = torch.randint(0, 4000, (t,), generator=g, device="cuda")
    rows = torch.zeros(400, hkv, d, dtype=torch.float8_e4m3fn, device="cuda")
    loc = torch.randperm(100, generator=g, device="cuda")[:t]
    out = rope_store(pos, q, k, v, rc.cos_sin(), rows, loc, 100, 200, k_scale=0.5, v_scale=2.0)
    cos, sin = rc.cos[pos].unsqueeze(1), rc.sin[pos].unsqueeze(1)
    x1, x2 = k.float().chunk(2, dim=-1)
    k_rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    assert rel_err(out.float(), RotaryCache.rotate(q.float(), cos, sin)) < 8e-3
    same_k = rows[loc + 100].view(torch.uint8) == to_fp8(k_rot, 0.5).view(torch.uint8)
    same_v = rows[loc + 200].view(torch.uint8) == to_fp8(v, 2.0).view(torch.uint8)
    assert same_k.float().mean() > 0.99 and bool(same_v.all())
    # e4m3 queries for FA3's FP8 prefill: the rotation rounded to 16 bits, then to e4m3 saturated at +-448 (what
    # the cast of a 16-bit q writes; a 64x larger input here lands some rotated values past 448).
    q8 = rope_store(pos, q * 64, k, v, rc.cos_sin(), rows, loc, 100, 200, k_scale=0.5, v_scale=2.0, q_fp8=True)
    q_rot = RotaryCache.rotate((q * 64).float(), cos, sin)
    assert q8.dtype == torch.float8_e4m3fn and bool((q_rot.abs() > 448).any())
    same_q = q8.view(torch.uint8) == to_fp8(q_rot.to(q.dtype)).view(torch.uint8)
    assert same_q.float().mean() > 0.99


@pytest.mark.parametrize("pool", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64)])  # llama-3.1-8b's heads, SmolLM2-135M's
def test_qkv_gemv_rotates_and_writes_kv_as_the_rope_store_kernel(pool, fp8, rows, hq, hkv, d):
    """The qkv GEMV's RoPE + K/V-write epilogue (`kv_write`) against the unfused GEMV followed by `rope_store`: the
    same rotated q and the same pool bytes (but for rounding ties), each token's K and V rows and nothing else."""
    from common.engine.gpu.fused_gemv import gemv
    from common.engine.gpu.rope_store import rope_store
    from common.engine.layers import KvWrite, RotaryCache
    from common.engine.model_config import RopeConfig

    g = torch.Generator(device="cuda").manual_seed(rows + hq)
    hidden = 4096 if hq == 32 else 576
    n = (hq + 2 * hkv) * d
    dense = (torch.randn(n, hidden, generator=g, device="cuda") * hidden**-0.5).to(torch.bfloat16)
    w, scale, _ = weight_operand(dense, fp8)
    x = torch.randn(rows, hidden, generator=g, device="cuda").to(torch.bfloat16)
    rc = RotaryCache.build(d, RopeConfig(), 4096, torch.device("cuda"))
    pos = torch.randint(0, 4000, (rows,), generator=g, device="cuda")
    loc = torch.randperm(100, generator=g, device="cuda")[:rows]
    scales = (0.5, 2.0) if pool == torch.float8_e4m3fn else (1.0, 1.0)
    fused, unfused = (torch.zeros(400, hkv, d, dtype=pool, device="cuda") for _ in range(2))
    q, none = gemv(x, w, weight_scale=scale, kv_write=KvWrite(pos, rc.cos_sin(), fused, loc, 100, 200, *scales))
    qkv, _ = gemv(x, w, weight_scale=scale)
    qq, kk, vv = (p.view(rows, -1, d) for p in qkv.split((hq * d, hkv * d, hkv * d), -1))
    q_ref = rope_store(pos, qq, kk, vv, rc.cos_sin(), unfused, loc, 100, 200, k_scale=scales[0], v_scale=scales[1])
    assert none is None and q.shape == (rows, hq, d) and q.dtype == torch.bfloat16
    assert (q != q_ref).float().mean() < 1e-3  # ties may round apart
    assert rel_err(q, q_ref.double()) < 1e-3
    same = fused.view(torch.uint8) == unfused.view(torch.uint8)
    assert same.float().mean() > 0.999
    written = (fused.view(torch.uint8) != 0).flatten(1).any(1).nonzero().flatten()
    assert sorted(written.tolist()) == sorted((loc + 100).tolist() + (loc + 200).tolist())


@pytest.mark.parametrize("rows", [1, 37, 300])
@pytest.mark.parametrize("hidden,inter", [(576, 1536), (4096, 14336), (4096, 18944)])
def test_fused_fp8_quantization_writes_what_the_unfused_ops_quantize(rows, hidden, inter):
    """Add + RMSNorm + per-token FP8 quantization, and SiLU-mul + quantization, each one Triton launch, against
    flashinfer's 16-bit op followed by `quantize_rows` (the path they replace): the same scales, the same e4m3 bytes
    but for rounding ties, the residual stream updated alike; and the saturating cast of attention's queries."""
    import flashinfer

    from common.engine.fp8 import quantize_rows, to_fp8
    from common.engine.gpu import fp8_quant

    g = torch.Generator(device="cuda").manual_seed(rows + hidden + inter)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    def same(a, b) -> None:
        (q, s), (q_ref, s_ref) = a, b
        torch.testing.assert_close(s, s_ref, rtol=1e-2, atol=0)  # a 16-bit rounding of the row's largest value
        assert q.shape == q_ref.shape and q.dtype == q_ref.dtype
        deq, deq_ref = q.float() * s, q_ref.float() * s_ref
        assert rel_err(deq, deq_ref.double()) < 1e-2
        assert (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean() < 2e-2

    x, res, w = randn(rows, hidden), randn(rows, hidden, scale=4.0), 1.0 + randn(hidden, scale=0.2)
    q, s, stream = fp8_quant.add_rms_norm_quant(x, None, w, 1e-6)
    assert stream is x
    same((q, s), quantize_rows(flashinfer.rmsnorm(x, w, 1e-6)))
    res_fused, x_ref, res_ref = res.clone(), x.clone(), res.clone()
    q, s, stream = fp8_quant.add_rms_norm_quant(x, res_fused, w, 1e-6)
    flashinfer.fused_add_rmsnorm(x_ref, res_ref, w, 1e-6)  # res_ref += x; x_ref = norm(res_ref)
    assert stream is res_fused and torch.equal(res_fused, res_ref)
    same((q, s), quantize_rows(x_ref))

    gate_up = randn(rows, 2 * inter, scale=2.0)
    expected = quantize_rows(flashinfer.silu_and_mul(gate_up))
    for one_pass in (True, False):
        same(fp8_quant.silu_mul_quant(gate_up, one_pass=one_pass), expected)

    qh = randn(rows, 8, 64, scale=100.0)  # past e4m3's 448 in places: saturated, not NaN
    sat = fp8_quant.saturate(qh)
    assert sat.shape == qh.shape and torch.equal(sat.view(torch.uint8), to_fp8(qh).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_two_launch_argmax_matches_torch_at_a_128k_vocabulary(rows, dtype):
    """Greedy sampling's argmax (common/engine/sampling.py `argmax_rows`) against torch's: the same ids, ties to the
    lowest id across chunks, a row of -inf to id 0."""
    from common.engine.gpu.argmax import argmax_rows

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 128256, generator=g, device="cuda").to(dtype)
    x[0, [120000, 70000]] = 100.0
    if rows > 1:
        x[1] = float("-inf")
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))
    assert int(got[0]) == 70000
