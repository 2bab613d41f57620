"""What the paged decode-attention tests share: the CSR description of requests' pages (flashinfer's indptr and
last-page lengths) and float64 attention over the stored page values times their K/V scales."""

from __future__ import annotations

import torch


def csr_lengths(lens: list[int], page_size: int, device: torch.device | str) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(total pages, indptr [B + 1] int32, last-page lengths [B] int32) of requests `lens` tokens long."""
    npages = [-(-n // page_size) for n in lens]
    indptr = torch.tensor([0, *torch.tensor(npages).cumsum(0).tolist()], dtype=torch.int32, device=device)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, npages)], dtype=torch.int32, device=device)
    return sum(npages), indptr, last


def attention_float64(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    lens: list[int],
    k_scale: float,
    v_scale: float,
) -> list[torch.Tensor]:
    """Each request's attention output [Hq, D] float64: q [B, Hq, D] over its pages `indices[indptr[i]:indptr[i+1]]`
    of the NHD caches [pages, page_size, Hkv, D], the first `lens[i]` tokens."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    group = hq // hkv
    refs = []
    for i, n in enumerate(lens):
        pg = indices[indptr[i] : indptr[i + 1]].long()
        kk = (k_cache[pg].reshape(-1, hkv, d)[:n].double() * k_scale).repeat_interleave(group, 1)  # [n, Hq, D]
        vv = (v_cache[pg].reshape(-1, hkv, d)[:n].double() * v_scale).repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), kk) * d**-0.5
        refs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), vv))
    return refs


def mla_attention_float64(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    lens: list[int],
    scale: float,
) -> list[torch.Tensor]:
    """Each request's absorbed latent attention [H, rank] float64: every head scores q_nope . c_kv + q_pe . k_pe
    over the request's latent pages (`ckv` [pages, page_size, rank], `kpe` [pages, page_size, rope]), the first
    `lens[i]` tokens, and averages the latents themselves."""
    refs = []
    for i, n in enumerate(lens):
        pg = indices[indptr[i] : indptr[i + 1]].long()
        c = ckv[pg].reshape(-1, ckv.shape[-1])[:n].double()
        kp = kpe[pg].reshape(-1, kpe.shape[-1])[:n].double()
        scores = (q_nope[i].double() @ c.T + q_pe[i].double() @ kp.T) * scale  # [H, n]
        refs.append(scores.softmax(-1) @ c)
    return refs
