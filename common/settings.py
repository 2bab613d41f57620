"""Engine, scheduler and HTTP settings: plain dataclasses with no torch, so the router can read them cheaply.

Fields bound to a `KVFERRY_*` setting take its default and docs from common/settings_registry.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common import settings_registry as reg
from common.settings_registry import ITL_TARGET_AUTO, ITL_TARGET_SLO

__all__ = ["ITL_TARGET_AUTO", "ITL_TARGET_SLO", "HttpLimits", "RunnerConfig", "SchedulerConfig"]


@dataclass
class RunnerConfig:
    model: str = reg.MODEL.field()
    device: str = reg.DEVICE.field()
    dtype: str = reg.DTYPE.field()
    kv_dtype: str = reg.KV_DTYPE.field()
    weight_dtype: str = reg.WEIGHT_DTYPE.field()
    page_size: int = reg.PAGE_SIZE.field()
    num_pages: int = reg.NUM_PAGES.field()
    # 0: chosen at start: on a GPU, the device memory free after the weights minus a reserve for activations,
    # CUDA graphs and workspaces (common/engine/kv_sizing.py); on the CPU, 1 GiB.
    kv_memory_gb: float = reg.KV_MEMORY_GB.field()
    max_running: int = reg.MAX_RUNNING.field()  # WorkerConfig.from_env defaults it by device (GPU 256, CPU 64)
    max_seq_len: int = reg.MAX_SEQ_LEN.field()
    seed: int = 0
    attention: str = reg.ATTENTION.field()
    cuda_graph_max_bs: int = reg.CUDA_GRAPH_MAX_BS.field()
    cuda_graph_max_tokens: int = reg.CUDA_GRAPH_MAX_TOKENS.field()
    decode_tc_min_batch: int = reg.DECODE_TC_MIN_BS.field()
    # GPU: Triton kernels (RoPE + K/V write in one; the GEMMs of steps of at most gemv_max_rows rows as GEMVs;
    # common/engine/gpu/). Off: flashinfer + cuBLAS only (the ablation baseline). gemv_prologues also folds the
    # norms and SiLU-mul into those GEMVs (measured slower on the H200; for benchmarks). gemv_stream_stats: one-row
    # steps add the o and down projections into the residual stream in their GEMVs, and the next GEMV applies
    # the norm from the statistics those leave (no norm kernels; off for benchmarks' A/B); gemv_gated: there the
    # gate_up GEMV applies silu(gate) * up in its epilogue too (no SiLU-mul kernels); gemv_rope: the qkv GEMV
    # applies RoPE and writes K/V into the pool in its epilogue (no RoPE + K/V-write kernels at those rows).
    fused_kernels: bool = reg.FUSED_KERNELS.field()
    gemv_max_rows: int = reg.GEMV_MAX_ROWS.field()
    gemv_prologues: bool = False
    gemv_stream_stats: bool = True
    gemv_gated: bool = True
    gemv_rope: bool = True
    # Mixture-of-experts layers at those rows: the experts as two GEMV kernels reading each routed expert once
    # (common/engine/gpu/moe_gemv.py) instead of the grouped GEMMs, and softmax top-k routing as one kernel
    # (common/engine/gpu/moe_route.py); off for benchmarks' A/B.
    gemv_experts: bool = True
    # Hopper: programmatic dependent launches (common/engine/gpu/pdl.py).
    pdl: bool = reg.PDL.field()
    cpu_linear: str = "auto"  # CPU float32 GEMMs: auto = oneDNN with packed weights when available; torch = F.linear
    tp_size: int = reg.TP_SIZE.field()  # rank 0 launches the others (common/engine/tp_ranks.py)
    tp_rank: int = 0  # set by rank 0 for its followers
    tp_port: int = 0  # rank 0's TCPStore port (followers)
    tp_shm: str = ""  # shared-memory path prefix of the CPU ranks' KV pools (followers)
    tp_same_device: bool = False  # GPU: every rank on cfg.device, collectives via the host (checks on one GPU)
    # How other workers reach the ranks' KV: "shared" = rank 0 registers every rank's pool (CPU shared
    # memory), "per-rank" = each follower runs its own NIXL agent (GPU), "auto" = by device.
    tp_transfer: str = reg.TP_TRANSFER.field()
    tp_agent_name: str = ""  # per-rank: rank 0's NIXL agent name; follower r's agent is "<name>-r<r>"
    # The module rank 0 runs as each follower process (`python -m <module> <config JSON>`): the engine's own
    # replays steps; a serving layer that gives each rank a NIXL agent names its own (common/serving/tp_follower.py).
    tp_follower_main: str = "common.engine.tp_follower"


@dataclass
class SchedulerConfig:
    max_prefill_tokens: int = reg.MAX_PREFILL_TOKENS.field()
    enable_prefix_cache: bool = True
    # Stall-free batching (common/sched/prefill_budget.py): every step decodes every running request and takes
    # prompt chunks up to what fits in this ITL target. ITL_TARGET_SLO (inf, the default): the SLO classes'
    # (below); below 0: -itl_target_ms of the engine's measured decode steps (ITL_TARGET_AUTO: 2); > 0:
    # milliseconds; 0: prefill-first (decoding waits for whole prompts).
    itl_target_ms: float = reg.ITL_TARGET_MS.field()
    grammar_compile_timeout_s: float = reg.GRAMMAR_COMPILE_TIMEOUT_S.field()  # then the request fails alone
    max_step_ms: float = reg.MAX_STEP_MS.field()  # no planned step longer (commands wait between steps)
    # The SLO declaration (common/slo.py): request classes and their targets, and the default class.
    slo_classes: str = reg.SLO_CLASSES.field()
    slo_default_class: str = reg.SLO_DEFAULT_CLASS.field()
    # GiB of host memory behind the prefix cache (common/kv/host_tier.py); 0: none; negative: chosen at start
    # (a GPU worker: 30% of the host memory it may use; the CPU: none).
    host_kv_gb: float = reg.HOST_KV_GB.field()
    # auto: overlap on a GPU at TP=1, off otherwise (common/sched/scheduler.py); on | off force it (on runs the
    # GPU loop's shape on the CPU, for tests).
    overlap: str = reg.OVERLAP.field()
    # full | optimistic: what an admitted request's KV reservation covers (common/sched/pages.py).
    kv_reservation: str = reg.KV_RESERVATION.field()


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP request and connection may cost the router or a worker's control plane (`KVFERRY_HTTP_*`;
    docs/reliability.md lists them with what a client sees). The protocol side is common/http_server.py, the
    request side common/http_guard.py."""

    max_url_bytes: int = reg.HTTP_MAX_URL_BYTES.field()
    max_header_bytes: int = reg.HTTP_MAX_HEADER_BYTES.field()
    max_header_count: int = reg.HTTP_MAX_HEADER_COUNT.field()
    max_body_bytes: int = reg.HTTP_MAX_BODY_BYTES.field()
    max_internal_body_bytes: int = reg.HTTP_MAX_INTERNAL_BODY_BYTES.field()
    header_timeout_s: float = reg.HTTP_HEADER_TIMEOUT_S.field()
    body_timeout_s: float = reg.HTTP_BODY_TIMEOUT_S.field()
    write_timeout_s: float = reg.HTTP_WRITE_TIMEOUT_S.field()
    keep_alive_s: float = reg.HTTP_KEEP_ALIVE_S.field()
    max_connections: int = reg.HTTP_MAX_CONNECTIONS.field()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HttpLimits:
        return cls(**reg.read_fields(cls, environ))
