"""Engine, scheduler and HTTP settings: plain dataclasses with no torch, so the router can read them cheaply."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass
class RunnerConfig:
    model: str = "smollm2-135m-instruct"  # the default's name, a local HF dir, or "dummy:<named config>"
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    page_size: int = 16
    num_pages: int = 0  # 0: from kv_memory_gb
    # 0: chosen at start: on a GPU, the device memory free after the weights minus a reserve for activations,
    # CUDA graphs and workspaces (common/engine/kv_sizing.py); on the CPU, 1 GiB.
    kv_memory_gb: float = 0.0
    max_running: int = 64  # batch slots; WorkerConfig.from_env defaults it by device (GPU 256, CPU 64)
    max_seq_len: int = 0  # 0: the model's context length
    seed: int = 0
    attention: str = "auto"  # auto: flashinfer on CUDA with a 16-bit dtype, else torch; or "torch" / "flashinfer"
    cuda_graph_max_bs: int = -1  # GPU path: decode CUDA graphs up to this batch (-1: max_running, 0: none)
    decode_tc_min_batch: int = 1  # GPU: decode batches below this use CUDA-core attention (1: tensor cores always)
    # GPU: Triton kernels (RoPE + K/V write in one; the GEMMs of steps of at most gemv_max_rows rows as GEMVs;
    # common/engine/gpu/). Off: flashinfer + cuBLAS only (the ablation baseline). gemv_prologues also folds the
    # norms and SiLU-mul into those GEMVs (measured slower on the H200; for benchmarks).
    fused_kernels: bool = True
    gemv_max_rows: int = 8
    gemv_prologues: bool = False
    cpu_linear: str = "auto"  # CPU float32 GEMMs: auto = oneDNN with packed weights when available; torch = F.linear
    tp_size: int = 1  # tensor-parallel ranks (rank 0 launches the others; see common/engine/tp_ranks.py)
    tp_rank: int = 0  # set by rank 0 for its followers
    tp_port: int = 0  # rank 0's TCPStore port (followers)
    tp_shm: str = ""  # shared-memory path prefix of the CPU ranks' KV pools (followers)
    tp_same_device: bool = False  # GPU: every rank on cfg.device, collectives via the host (checks on one GPU)
    # How other workers reach the ranks' KV: "shared" = rank 0 registers every rank's pool (CPU shared
    # memory), "per-rank" = each follower runs its own NIXL agent (GPU), "auto" = by device.
    tp_transfer: str = "auto"
    tp_agent_name: str = ""  # per-rank: rank 0's NIXL agent name; follower r's agent is "<name>-r<r>"
    # The module rank 0 runs as each follower process (`python -m <module> <config JSON>`): the engine's own
    # replays steps; a serving layer that gives each rank a NIXL agent names its own (common/serving/tp_follower.py).
    tp_follower_main: str = "common.engine.tp_follower"


ITL_TARGET_AUTO = -1.0  # `SchedulerConfig.itl_target_ms`: the target follows the engine's own decode step


@dataclass
class SchedulerConfig:
    max_prefill_tokens: int = 2048
    enable_prefix_cache: bool = True
    # Stall-free batching (common/sched/prefill_budget.py): every step decodes every running request and takes
    # prompt chunks up to what fits in this ITL target. ITL_TARGET_AUTO (the default): a multiple of the
    # engine's measured decode step; > 0: milliseconds; 0: prefill-first (decoding waits for whole prompts).
    itl_target_ms: float = ITL_TARGET_AUTO
    # GiB of host memory behind the prefix cache (common/kv/host_tier.py); 0: none; negative: chosen at start
    # (a GPU worker: 30% of the host memory it may use; the CPU: none).
    host_kv_gb: float = -1.0
    # auto: overlap on a GPU at TP=1, off otherwise (common/sched/scheduler.py); on | off force it (on runs the
    # GPU loop's shape on the CPU, for tests).
    overlap: str = "auto"


_HTTP_ENV_PREFIX = "KVFERRY_HTTP_"


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP request and connection may cost the router or a worker's control plane.

    Each is set by ``KVFERRY_HTTP_<NAME>`` (e.g. ``KVFERRY_HTTP_MAX_HEADER_BYTES``); docs/reliability.md lists
    them with what a client sees. The protocol side is common/http_server.py, the request side
    common/http_guard.py.
    """

    max_url_bytes: int = 8 * 1024  # the request target (path and query): 414 above
    max_header_bytes: int = 64 * 1024  # every header line together: 431 above
    max_header_count: int = 128  # 431 above
    max_body_bytes: int = 8 * 1024 * 1024  # 413 above (declared or streamed)
    # From a connection's first byte of a request (or its opening) to the end of the headers: then 408, close.
    header_timeout_s: float = 15.0
    # From the end of the headers to the end of the body: then 408 (or a close, once a response has begun).
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0  # an idle connection between requests is closed after this
    # Open connections per server process; a request beyond it gets 503 (uvicorn's limit_concurrency). 0: none.
    max_connections: int = 16384

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HttpLimits:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(_HTTP_ENV_PREFIX + f.name.upper())
            if raw:
                values[f.name] = type(getattr(cls, f.name))(raw)
        return cls(**values)
