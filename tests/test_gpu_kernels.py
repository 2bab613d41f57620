"""The Triton kernels of the GPU path against float64 references, on fresh random inputs with poisoned outputs.

GPU-only (they skip without CUDA); on the CPU the same contract is the model's `TorchOps`, which every engine
test runs.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.skipif(not CUDA, reason="needs a CUDA device"), pytest.mark.gpu]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def _reference(prologue: str, x, weight, bias, residual, norm_weight, eps):
    xd = x.double()
    new_res = None
    if prologue == "silu":
        k = weight.shape[1]
        g, u = xd[:, :k], xd[:, k:]
        a = g * torch.sigmoid(g) * u
    elif prologue in ("norm", "add_norm"):
        s = xd
        if prologue == "add_norm":
            new_res = (x.float() + residual.float()).to(x.dtype)
            s = new_res.double()
        a = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    else:
        a = xd
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
    assert _rel(y, ref) < 8e-3  # bf16 operands, float32 accumulation
    if prologue == "add_norm":
        assert new_res is not None and torch.equal(new_res, ref_res)
    else:
        assert new_res is None
    # The inputs are read, never written.
    assert torch.isfinite(x).all()


def test_gemv_writes_every_output_and_nothing_else():
    """Outputs come from fresh buffers; run it twice on new inputs: no stale value survives (poisoned x)."""
    from common.engine.gpu.fused_gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(5)
    weight = torch.randn(777, 512, generator=g, device="cuda").to(torch.bfloat16) * 0.04
    for rows in (1, 3):
        for _ in range(2):
            x = torch.randn(rows, 512, generator=g, device="cuda").to(torch.bfloat16)
            y, _ = gemv(x, weight)
            assert _rel(y, x.double() @ weight.double().T) < 8e-3


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
def test_decode_attention_matches_float64(hq, hkv, d, splits):
    """Split-KV decode over shuffled pages, lengths with partial last pages (1 token, one page + 1, long)."""
    from common.engine.gpu.decode_attention import decode_attention

    g = torch.Generator(device="cuda").manual_seed(hq * 31 + splits)
    ps, pages = 16, 400
    lens = [1, 17, 300, 1000, 64]
    kv = torch.randn(pages, 3, 2, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    layer = 1
    k_cache, v_cache = kv[:, layer, 0], kv[:, layer, 1]
    perm = torch.randperm(pages, generator=g, device="cuda")
    npages = [-(-n // ps) for n in lens]
    indptr = torch.tensor([0, *torch.tensor(npages).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    indices = perm[: sum(npages)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(lens, npages)], dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), hq, d, generator=g, device="cuda").to(torch.bfloat16)
    out = decode_attention(q, k_cache, v_cache, indptr, indices, last, splits)
    group = hq // hkv
    for i, n in enumerate(lens):
        pg = indices[indptr[i] : indptr[i + 1]].long()
        kk = k_cache[pg].reshape(-1, hkv, d)[:n].double().repeat_interleave(group, 1)  # [n, Hq, D]
        vv = v_cache[pg].reshape(-1, hkv, d)[:n].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), kk) * d**-0.5
        ref = torch.einsum("hn,nhd->hd", scores.softmax(-1), vv)
        assert torch.isfinite(out[i]).all()
        assert _rel(out[i], ref) < 1e-2, (i, n)
