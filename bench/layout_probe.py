"""Probe for the KV layout decision (GPU): how NIXL throughput depends on descriptor count, and whether
flashinfer reads a page-major pool (one page of every layer contiguous) through strided per-layer views.

    python bench/layout_probe.py          # on the GPU machine; writes bench/out/layout_probe.json

Part A: one process writes 512 MiB into another's VRAM as N equal descriptors, N in 1..4096, against a
device-to-device copy of the same bytes in this process. Part B: flashinfer decode and prefill over
per-layer views `kv[:, l, 0|1]` of a `[pages, layers, 2, page, H, D]` tensor vs contiguous copies.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import torch

TOTAL = 512 << 20
COUNTS = [1, 16, 64, 256, 1024, 4096]


def _agent(name: str, buf: torch.Tensor):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    agent.register_memory(buf, backends=["UCX"])
    return agent


def receiver(q_in, q_out) -> None:
    buf = torch.zeros(TOTAL, dtype=torch.uint8, device="cuda")
    agent = _agent("rx", buf)
    q_out.put((agent.get_agent_metadata(), buf.data_ptr()))
    q_in.get()  # until the sender is done


def descs(base: int, n: int) -> np.ndarray:
    size = TOTAL // n
    addr = base + np.arange(n, dtype=np.uint64) * size
    return np.stack([addr, np.full(n, size, np.uint64), np.zeros(n, np.uint64)], axis=1)


def part_a() -> dict:
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=receiver, args=(q_in, q_out))
    p.start()
    meta, remote_base = q_out.get(timeout=120)
    src = torch.randint(0, 255, (TOTAL,), dtype=torch.uint8, device="cuda")
    agent = _agent("tx", src)
    peer = agent.add_remote_agent(meta)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    out = {}
    for n in COUNTS:
        times = []
        for rep in range(6):
            t0 = time.perf_counter()
            h = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(descs(src.data_ptr(), n), "VRAM"),
                agent.get_xfer_descs(descs(remote_base, n), "VRAM"),
                peer,
            )
            t_post0 = time.perf_counter()
            st = agent.transfer(h)
            t_post = time.perf_counter() - t_post0
            while st not in ("DONE", "ERR"):
                st = agent.check_xfer_state(h)
            dt = time.perf_counter() - t0
            agent.release_xfer_handle(h)
            if rep:  # the first one sets up CUDA IPC handles
                times.append((dt, t_post))
        best = min(t for t, _ in times)
        out[n] = {"gbps": TOTAL / best / 1e9, "seconds": best, "post_s": min(p for _, p in times), "state": st}
        print(f"A n={n:5d}: {TOTAL / best / 1e9:8.1f} GB/s ({best * 1e3:.2f} ms)", flush=True)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    copy = TOTAL / ((time.perf_counter() - t0) / 10) / 1e9
    print(f"A copy: {copy:.1f} GB/s (read+write counted once)", flush=True)
    q_in.put(None)
    p.join(30)
    return {"nixl": out, "copy_gbps": copy}


def part_b() -> dict:
    import flashinfer

    torch.manual_seed(0)
    P, L, ps, H, Hq, D = 512, 4, 16, 8, 32, 128
    kvp = torch.randn(P, L, 2, ps, H, D, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    bs, pages_per = 8, 40
    indptr = torch.arange(0, bs * pages_per + 1, pages_per, dtype=torch.int32, device="cuda")
    indices = torch.randperm(P, device="cuda")[: bs * pages_per].int()
    last = torch.full((bs,), 7, dtype=torch.int32, device="cuda")
    res = {}
    for tc in (False, True):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
        w.plan(indptr, indices, last, Hq, H, D, ps, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        q = torch.randn(bs, Hq, D, dtype=torch.bfloat16, device="cuda")
        errs = []
        for layer in range(L):
            k, v = kvp[:, layer, 0], kvp[:, layer, 1]
            strided = w.run(q, (k, v))
            contig = w.run(q, (k.contiguous(), v.contiguous()))
            errs.append(float((strided.float() - contig.float()).abs().max()))
        res[f"decode_tc{int(tc)}_max_abs_diff"] = max(errs)
    qo = torch.arange(0, bs * 32 + 1, 32, dtype=torch.int32, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(
        qo, indptr, indices, last, Hq, H, D, ps, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16
    )
    q = torch.randn(bs * 32, Hq, D, dtype=torch.bfloat16, device="cuda")
    k, v = kvp[:, 1, 0], kvp[:, 1, 1]
    res["prefill_max_abs_diff"] = float(
        (w.run(q, (k, v)).float() - w.run(q, (k.contiguous(), v.contiguous())).float()).abs().max()
    )
    print("B", res, flush=True)
    return res


def main() -> None:
    out = {}
    try:
        out["flashinfer_strided"] = part_b()
    except Exception as e:  # report, then still measure part A
        out["flashinfer_strided"] = {"error": f"{type(e).__name__}: {e}"}
        print("B failed:", e, flush=True)
    out["nixl_descriptors"] = part_a()
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/out")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "layout_probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
