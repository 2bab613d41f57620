"""KV transfer throughput, sender process -> receiver process, against a plain copy of the same pages.

    python bench/transfer.py --device cpu --layout smollm2
    python bench/transfer.py --device cuda --layout llama8b
    python bench/transfer.py --device cuda --layout llama8b --dst-tp 2   # TP=1 prefill -> TP=2 decode
    python bench/transfer.py --device cuda --layout deepseek-v2-lite     # MLA latent pages (one entry per token)

With `--dst-tp N` the receiver splits the KV heads over N rank pools (as a TP=N decode worker does) and the
sender packs each rank's heads through its staging area before moving them; same bytes, same copy baseline.

For 1k, 4k and 16k-token prompts the sender (this process) writes the prompt's pages into pages that
the receiver (a spawned process, as a decode worker would be) reserved, in chunks of
`--chunk-tokens` through `RequestTransfer`, ending with a notification. Destination pages come in
shuffled blocks of `--run-pages` pages (a used decode pool is fragmented), so each chunk is a few
runs and each run one descriptor (the pool is page-major). The baseline is a torch copy of the same page
runs between two pools inside this process. The first transfer (connection set-up) is reported apart.

Overlap mode: per chunk, post the write then run a matmul of about the chunk's transfer time, then
wait; compared with doing the writes and the compute one after the other.

Writes `bench/out/transfer_<device>.json`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable (and in spawned children)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from common.kv.pool import KVLayout, KVPool, checksums_match
from common.protocol import KVLayoutInfo, decode, encode
from common.transfer.agent import KVTransferAgent
from common.transfer.descs import page_runs
from common.transfer.request_transfer import RequestTransfer, open_request
from common.transfer.sender import KVSender
from common.transfer.session import TERMINAL, SessionState

LAYOUTS = {
    # SmolLM2-135M: 30 layers, 3 KV heads, head dim 64; float32 on CPU (45 KiB/token).
    "smollm2": dict(num_layers=30, num_kv_heads=3, head_dim=64),
    # Llama-3-8B: 32 layers, 8 KV heads, head dim 128; bf16 = 128 KiB/token.
    "llama8b": dict(num_layers=32, num_kv_heads=8, head_dim=128),
    # DeepSeek-V2-Lite's latent pages: 27 layers, one [512 latent | 64 RoPE key] entry per token; bf16 = 30 KiB/token.
    "deepseek-v2-lite": dict(num_layers=27, num_kv_heads=1, head_dim=576, kv_parts=1),
}
SIZES = [1024, 4096, 16384]
MODEL = "bench"
TIMEOUT_S = 120.0


def make_layout(name: str, device: str, page_size: int, kv_dtype: str = "auto") -> KVLayout:
    if kv_dtype == "fp8":
        dtype = torch.float8_e4m3fn
    else:
        dtype = torch.bfloat16 if (name != "smollm2" or device == "cuda") else torch.float32
    return KVLayout(page_size=page_size, dtype=dtype, **LAYOUTS[name])


def sync(device: str) -> None:
    if device == "cuda":
        for i in range(torch.cuda.device_count()):  # a cross-GPU copy involves both devices
            torch.cuda.synchronize(i)


# -- receiver process --------------------------------------------------------------------------------


def receiver_main(cfg: dict[str, Any], cmd_q: Any, out_q: Any) -> None:
    """A decode worker reduced to its transfer part: hand out the handshake, report notifications."""
    from dataclasses import replace

    from common.engine.tp import split_range
    from common.transfer.receiver import KVReceiver

    layout = make_layout(cfg["layout"], cfg["device"], cfg["page_size"], cfg["kv_dtype"])
    ranks = [split_range(layout.num_kv_heads, cfg["dst_tp"], r) for r in range(cfg["dst_tp"])]
    dev = cfg["dst_device"]
    pools = [KVPool(replace(layout, num_kv_heads=hi - lo), cfg["num_pages"], dev) for lo, hi in ranks]
    pool = pools[0]
    agent = KVTransferAgent(
        "bench-decode",
        pool,
        model_id=MODEL,
        rank_pools=list(zip(pools, ranks)),
        progress_thread=cfg["progress_thread"],
        backend_params=cfg["backend_params"],
        progress_delay_us=cfg["progress_delay_us"],
    )
    receiver = KVReceiver(agent)
    out_q.put(
        {
            "agent_name": agent.name,
            "instance_id": agent.instance_id,
            "metadata_b64": agent.metadata_b64(),
            "pool_info_b64": agent.pool_info_b64(),
            "layout": encode(agent.layout).decode(),
        }
    )
    while True:
        for _, msg in receiver.poll_notifications():
            out_q.put(("notif", msg, time.monotonic()))  # CLOCK_MONOTONIC is host-wide on Linux
        try:
            cmd = cmd_q.get_nowait()
        except queue.Empty:
            time.sleep(0.0002)  # light polling: on a small CPU box the sender needs the cores
            continue
        if cmd[0] == "stop":
            break
        if cmd[0] == "checksums":
            sums = torch.stack([p.page_checksums(torch.tensor(cmd[1])) for p in pools]).sum(0)
            out_q.put(("checksums", sums.tolist()))
    agent.close()


# -- sender side -------------------------------------------------------------------------------------


@dataclass
class Rep:
    seconds: float  # first post -> notification sent (all writes DONE)
    e2e_seconds: float  # first post -> receiver saw the notification
    descs: int
    xfers: int
    attached: bool = False  # the notice rode on the last write


def dst_pattern(n_pages: int, run_pages: int, num_pages: int, seed: int) -> torch.Tensor:
    """Destination pages as shuffled blocks of `run_pages` consecutive pages."""
    g = torch.Generator().manual_seed(seed)
    blocks = num_pages // run_pages
    order = torch.randperm(blocks, generator=g)[: (n_pages + run_pages - 1) // run_pages]
    pages = (order[:, None] * run_pages + torch.arange(run_pages)[None, :]).reshape(-1)
    return pages[:n_pages]


def one_transfer(
    sender: KVSender, rx: Any, src: torch.Tensor, dst: torch.Tensor, chunk_pages: int, tag: str, attach: bool = True
) -> Rep:
    """`attach`: the last chunk carries the notice where it can (`post_final`, what prefill workers do); else
    every chunk is posted and the notice sent on its own after they are done (`finish`)."""
    t0 = time.monotonic()
    rt: RequestTransfer = open_request(sender, tag, "bench-decode", TIMEOUT_S)
    last = ((src.numel() - 1) // chunk_pages) * chunk_pages
    for i in range(0, last, chunk_pages):
        rt.post(src[i : i + chunk_pages], dst[i : i + chunk_pages])
    if attach:
        state = rt.post_final(src[last:], dst[last:], tag.encode())
    else:
        rt.post(src[last:], dst[last:])
        state = rt.finish(tag.encode())
    if state not in TERMINAL:
        state = rt.wait()
    t1 = time.monotonic()
    if state is not SessionState.LANDED:
        raise RuntimeError(f"transfer failed: {rt.error}")
    kind, msg, t_seen = rx.get(timeout=TIMEOUT_S)
    if kind != "notif" or msg != tag.encode():
        raise RuntimeError(f"unexpected receiver message {kind} {msg!r}")
    return Rep(t1 - t0, t_seen - t0, rt.num_descs, len(rt.handles), rt.notice_attached)


def copy_runs(src_pool: KVPool, dst_pool: KVPool, src: torch.Tensor, dst: torch.Tensor) -> float:
    """The baseline: the same page runs copied by torch (one strided copy per run, all layers, K and V)."""
    runs = page_runs(src, dst)
    starts = zip(runs.src_start.tolist(), runs.dst_start.tolist(), runs.length.tolist(), strict=True)
    sync(src_pool.device.type)
    t0 = time.perf_counter()
    for s, d, n in starts:
        dst_pool.kv[d : d + n].copy_(src_pool.kv[s : s + n])
    sync(src_pool.device.type)
    return time.perf_counter() - t0


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def checksum_ok(pool: KVPool, rx: Any, cmd: Any, src: torch.Tensor, dst: torch.Tensor) -> bool:
    cmd.put(("checksums", dst.tolist()))
    kind, sums = rx.get(timeout=TIMEOUT_S)
    return kind == "checksums" and checksums_match(pool.page_checksums(src).tolist(), sums, abs_tol=1e-9)


def calibrated_compute(device: str, target_s: float) -> tuple[Any, int]:
    """A matmul loop of about `target_s`: a stand-in for the next chunk's forward pass."""
    n = 1024 if device == "cuda" else 384
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def step(k: int) -> None:
        for _ in range(k):
            torch.mm(a, b)
        sync(device)

    step(3)
    t0 = time.perf_counter()
    step(20)
    per = (time.perf_counter() - t0) / 20
    return step, max(1, round(target_s / per))


def run_overlap(args: argparse.Namespace, sender: KVSender, rx: Any, dst_all: torch.Tensor) -> dict:
    """Per chunk: post the write, compute, wait; against the same writes and compute one after the other.

    "inline" posts from the scheduler thread, as the prefill loop does. "thread" posts and waits from a
    helper thread while the main thread computes: it shows whether the post call itself blocks (on CPU
    DRAM, UCX's cma transport copies inside the post call, so only a second thread can overlap it).
    """
    tokens, chunk_pages = args.overlap_tokens, args.chunk_tokens // args.page_size
    n_pages = tokens // args.page_size
    src, dst = torch.arange(n_pages), dst_all[:n_pages]
    chunks = [(src[i : i + chunk_pages], dst[i : i + chunk_pages]) for i in range(0, n_pages, chunk_pages)]
    tags = iter(range(1 << 30))
    post_times: list[float] = []

    def write(s: torch.Tensor, d: torch.Tensor, between: Any = None) -> None:
        t0 = time.perf_counter()
        tag = f"ov-{next(tags)}"
        rt = open_request(sender, tag, "bench-decode", TIMEOUT_S)
        rt.post(s, d)
        post_times.append(time.perf_counter() - t0)
        if between is not None:
            between()
        rt.finish(tag.encode())
        if rt.wait() is not SessionState.LANDED:
            raise RuntimeError(rt.error)
        rx.get(timeout=TIMEOUT_S)

    def threaded(s: torch.Tensor, d: torch.Tensor, work: Any) -> None:
        th = threading.Thread(target=write, args=(s, d))
        th.start()
        work()
        th.join()

    def timed(fn: Any) -> float:
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs)

    for s, d in chunks:  # warm this page pattern once
        write(s, d)
    post_times.clear()
    t_xfer = timed(lambda: [write(s, d) for s, d in chunks])
    post_per_chunk = statistics.median(post_times)
    step, k = calibrated_compute(args.device, t_xfer / len(chunks))
    t_compute = timed(lambda: [step(k) for _ in chunks])
    t_inline = timed(lambda: [write(s, d, lambda: step(k)) for s, d in chunks])
    t_thread = timed(lambda: [threaded(s, d, lambda: step(k)) for s, d in chunks])
    serial = t_xfer + t_compute

    def hidden(t: float) -> float:  # 1.0: the shorter of transfer/compute fully hidden; 0: none
        return (serial - t) / min(t_xfer, t_compute)

    return {
        "tokens": tokens,
        "chunks": len(chunks),
        "post_s_per_chunk": post_per_chunk,
        "xfer_s": t_xfer,
        "compute_s": t_compute,
        "serial_s": serial,
        "post_compute_wait_s": t_inline,
        "hidden_fraction": hidden(t_inline),
        "threaded_post_compute_wait_s": t_thread,
        "threaded_hidden_fraction": hidden(t_thread),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="smollm2")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="prefill chunk = tokens per WRITE")
    ap.add_argument("--run-pages", type=int, default=16, help="destination fragmentation: pages per run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--sizes", default=",".join(map(str, SIZES)), help="prompt lengths in tokens (small ones show the fixed cost)"
    )
    ap.add_argument("--mode", choices=["throughput", "overlap", "both"], default="both")
    ap.add_argument("--overlap-tokens", type=int, default=8192)
    ap.add_argument(
        "--no-progress-thread",
        dest="progress_thread",
        action="store_false",
        help="run NIXL agents without their UCX progress thread (it spins; matters on few-core boxes)",
    )
    ap.add_argument(
        "--backend-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="NIXL UCX backend init parameter for both agents (e.g. num_threads=4), repeatable",
    )
    ap.add_argument(
        "--progress-delay-us", type=int, default=None, help="NIXL progress-thread sleep (default: the agent's choice)"
    )
    ap.add_argument("--dst-device", default="", help="receiver's device, e.g. cuda:1 (default: --device)")
    ap.add_argument("--dst-tp", type=int, default=1, help="receiver's tensor-parallel ranks (heads split over pools)")
    ap.add_argument("--staging-mb", type=int, default=1024, help="sender's packing area when --dst-tp > 1")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    ap.add_argument(
        "--kv-dtypes",
        default="auto",
        help="page formats, one receiver each, in one run: auto (bf16 on CUDA and for llama8b, else float32), "
        "fp8 (e4m3); with both, each size's transfer time of the second as a ratio to the first's",
    )
    args = ap.parse_args()
    results = {kv: run_one(args, kv) for kv in args.kv_dtypes.split(",")}
    if len(results) > 1:
        (a, ra), (b, rb) = list(results.items())[:2]
        for sa, sb in zip(ra.get("sizes", []), rb.get("sizes", [])):
            print(
                f"{sa['tokens']:>6} tokens: {b} {sb['xfer_s'] * 1e3:.2f} ms vs {a} {sa['xfer_s'] * 1e3:.2f} ms = "
                f"{sb['xfer_s'] / sa['xfer_s']:.2f}x the time, {sb['bytes'] / sa['bytes']:.2f}x the bytes",
                flush=True,
            )


def run_one(args: argparse.Namespace, kv_dtype: str) -> dict[str, Any]:
    sizes = [int(v) for v in args.sizes.split(",")]
    backend_params = dict(kv.split("=", 1) for kv in args.backend_param)
    layout = make_layout(args.layout, args.device, args.page_size, kv_dtype)
    max_pages = max(sizes + [args.overlap_tokens]) // args.page_size
    num_pages = (max_pages // args.run_pages + 4) * args.run_pages
    pool_gb = layout.bytes_per_token * layout.page_size * num_pages / 1e9
    print(
        f"layout {args.layout} {layout.dtype} on {args.device}: {layout.bytes_per_token / 1024:.0f} KiB/token, "
        f"{num_pages} pages/pool ({pool_gb:.2f} GB), chunk {args.chunk_tokens} tokens, runs of {args.run_pages} pages",
        flush=True,
    )

    ctx = mp.get_context("spawn")
    cmd, rx = ctx.Queue(), ctx.Queue()
    cfg = {
        "layout": args.layout,
        "device": args.device,
        "page_size": args.page_size,
        "num_pages": num_pages,
        "progress_thread": args.progress_thread,
        "backend_params": backend_params,
        "dst_tp": args.dst_tp,
        "dst_device": args.dst_device or args.device,
        "progress_delay_us": args.progress_delay_us,
        "kv_dtype": kv_dtype,
    }
    proc = ctx.Process(target=receiver_main, args=(cfg, cmd, rx), daemon=True)
    proc.start()
    try:
        pool = KVPool(layout, num_pages, args.device)
        if kv_dtype == "fp8":
            pool.kv.view(torch.uint8).random_(0, 0x7F)  # finite e4m3 values of both signs' magnitudes
        else:
            pool.kv.uniform_(-1, 1)
        copy_pool = KVPool(layout, num_pages, args.dst_device or args.device)  # cross-GPU: peer-to-peer copy
        agent = KVTransferAgent(
            "bench-prefill",
            pool,
            model_id=MODEL,
            progress_thread=args.progress_thread,
            backend_params=backend_params,
            staging_bytes=args.staging_mb << 20,
            progress_delay_us=args.progress_delay_us,
        )
        sender = KVSender(agent)
        hs = rx.get(timeout=TIMEOUT_S)
        sync(args.device)

        t0 = time.monotonic()
        agent.add_peer(
            hs["agent_name"],
            hs["instance_id"],
            hs["metadata_b64"],
            hs["pool_info_b64"],
            decode(hs["layout"], KVLayoutInfo),
        )
        handshake_s = time.monotonic() - t0
        dst_all = dst_pattern(max_pages, args.run_pages, num_pages, seed=1)
        chunk_pages = args.chunk_tokens // args.page_size

        # First transfer: UCX endpoint wire-up (and on CUDA the IPC handle mapping) lands here.
        n0 = sizes[0] // args.page_size
        first = one_transfer(sender, rx, torch.arange(n0), dst_all[:n0], chunk_pages, "first")
        first_bytes = n0 * layout.bytes_per_token * layout.page_size
        print(
            f"handshake (add_peer) {handshake_s * 1e3:.1f} ms; first transfer {sizes[0]} tokens: "
            f"{first.seconds * 1e3:.1f} ms = {gbps(first_bytes, first.seconds):.2f} GB/s",
            flush=True,
        )
        result: dict[str, Any] = {
            "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
            "cpu_count": os.cpu_count(),
            "layout": args.layout,
            "dtype": str(layout.dtype),
            "bytes_per_token": layout.bytes_per_token,
            "page_size": args.page_size,
            "chunk_tokens": args.chunk_tokens,
            "run_pages": args.run_pages,
            "progress_thread": args.progress_thread,
            "backend_params": backend_params,
            "dst_tp": args.dst_tp,
            "dst_device": args.dst_device or args.device,
            "progress_delay_us": args.progress_delay_us,
            "handshake_s": handshake_s,
            "first_transfer": {"tokens": sizes[0], **asdict(first), "gbps": gbps(first_bytes, first.seconds)},
            "sizes": [],
        }

        if args.mode in ("throughput", "both"):
            for tokens in sizes:
                n = tokens // args.page_size
                src, dst = torch.arange(n), dst_all[:n]
                nbytes = n * layout.bytes_per_token * layout.page_size
                reps = [one_transfer(sender, rx, src, dst, chunk_pages, f"t{tokens}-{i}") for i in range(args.reps)]
                # The same writes with the notice sent on its own after the last write is seen done.
                apart = [
                    one_transfer(sender, rx, src, dst, chunk_pages, f"s{tokens}-{i}", attach=False)
                    for i in range(args.reps)
                ]
                copies = [copy_runs(pool, copy_pool, src, dst) for _ in range(args.reps + 1)][1:]
                t_x = statistics.median(r.seconds for r in reps)
                t_e2e = statistics.median(r.e2e_seconds for r in reps)
                t_c = statistics.median(copies)
                row = {
                    "tokens": tokens,
                    "bytes": nbytes,
                    "xfer_s": t_x,
                    "gbps": gbps(nbytes, t_x),
                    "gbps_best": gbps(nbytes, min(r.seconds for r in reps)),
                    "e2e_gbps": gbps(nbytes, t_e2e),
                    "e2e_s": t_e2e,
                    "e2e_s_notice_apart": statistics.median(r.e2e_seconds for r in apart),
                    "notice_attached": reps[0].attached,
                    "copy_s": t_c,
                    "copy_gbps": gbps(nbytes, t_c),
                    "ratio": t_c / t_x,
                    "descs_per_transfer": reps[0].descs,
                    "xfers_per_transfer": reps[0].xfers,
                    "runs": page_runs(src, dst).count,
                    "verified": checksum_ok(pool, rx, cmd, src, dst),
                }
                result["sizes"].append(row)
                print(
                    f"{tokens:>6} tokens {nbytes / 1e6:8.1f} MB: transfer {row['gbps']:6.2f} GB/s "
                    f"(best {row['gbps_best']:.2f}, seen by receiver {row['e2e_gbps']:.2f}), "
                    f"copy {row['copy_gbps']:6.2f} GB/s, ratio {row['ratio']:.2f}, "
                    f"{row['descs_per_transfer']} descs in {row['xfers_per_transfer']} WRITEs, "
                    f"verified={row['verified']}; first post -> receiver saw the notice: "
                    f"{t_e2e * 1e3:.3f} ms with the notice on the last write (attached={row['notice_attached']}), "
                    f"{row['e2e_s_notice_apart'] * 1e3:.3f} ms sent apart "
                    f"({row['e2e_s_notice_apart'] / t_e2e:.2f}x)",
                    flush=True,
                )

        if args.mode in ("overlap", "both"):
            ov = run_overlap(args, sender, rx, dst_all)
            result["overlap"] = ov
            print(
                f"overlap {ov['tokens']} tokens in {ov['chunks']} chunks: (post+wait)+(compute) "
                f"{ov['xfer_s'] * 1e3:.1f}+{ov['compute_s'] * 1e3:.1f} = {ov['serial_s'] * 1e3:.1f} ms; "
                f"post+compute+wait {ov['post_compute_wait_s'] * 1e3:.1f} ms (hidden {ov['hidden_fraction']:.0%}), "
                f"posted from a thread {ov['threaded_post_compute_wait_s'] * 1e3:.1f} ms "
                f"(hidden {ov['threaded_hidden_fraction']:.0%}); post call {ov['post_s_per_chunk'] * 1e3:.2f} ms/chunk",
                flush=True,
            )

        sender.close()
        agent.close()
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = f"_dsttp{args.dst_tp}" if args.dst_tp > 1 else ""
        suffix += f"_to_{args.dst_device.replace(':', '')}" if args.dst_device else ""
        suffix += f"_runs{args.run_pages}" if args.run_pages != 16 else ""
        suffix += f"_delay{args.progress_delay_us}" if args.progress_delay_us is not None else ""
        suffix += "_fp8" if kv_dtype == "fp8" else ""
        suffix += "_deepseek-v2-lite" if args.layout == "deepseek-v2-lite" else ""
        path = args.out / f"transfer_{args.device}{suffix}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
        return result
    finally:
        cmd.put(("stop",))
        proc.join(15)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()
