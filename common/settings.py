"""Engine, scheduler and HTTP settings: torch-free dataclasses (the router reads them), defaults from
common/settings_registry.py."""

from __future__ import annotations

from dataclasses import dataclass

from common import settings_registry as reg
from common.settings_registry import ITL_TARGET_AUTO, ITL_TARGET_SLO

__all__ = ["ITL_TARGET_AUTO", "ITL_TARGET_SLO", "HttpLimits", "RunnerConfig", "SchedulerConfig"]


@dataclass
class RunnerConfig(reg.EnvFields):
    model: str = reg.MODEL.field()
    device: str = reg.DEVICE.field()
    dtype: str = reg.DTYPE.field()
    kv_dtype: str = reg.KV_DTYPE.field()
    weight_dtype: str = reg.WEIGHT_DTYPE.field()
    page_size: int = reg.PAGE_SIZE.field()
    num_pages: int = reg.NUM_PAGES.field()
    # 0: chosen at start (GPU: free memory after weights less a reserve, common/engine/kv_sizing.py; CPU: 1 GiB).
    kv_memory_gb: float = reg.KV_MEMORY_GB.field()
    max_running: int = reg.MAX_RUNNING.field()  # WorkerConfig.from_env defaults it by device (GPU 256, CPU 64)
    max_seq_len: int = reg.MAX_SEQ_LEN.field()
    seed: int = 0
    attention: str = reg.ATTENTION.field()
    cuda_graph_max_bs: int = reg.CUDA_GRAPH_MAX_BS.field()
    cuda_graph_max_tokens: int = reg.CUDA_GRAPH_MAX_TOKENS.field()
    decode_tc_min_batch: int = reg.DECODE_TC_MIN_BS.field()
    # GPU Triton kernels (docs/architecture.md, "GPU kernels"); off: flashinfer + cuBLAS only (the baseline).
    # The gemv_* switches pick which fusions the one-row GEMVs apply (A/B runs).
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
    # Latent attention's decode steps of a few requests on the split-KV Triton kernel
    # (common/engine/gpu/mla_decode.py); off: flashinfer's MLA kernel for every step. Off until the kernel has
    # been checked and timed on a GPU (its CPU check is the interpreted test); benchmarks turn it on for A/B.
    mla_split_decode: bool = False
    # Latent attention's eager prompt chunks with no cached prefix in the decompressed form (flashinfer's ragged
    # prefill over keys and values expanded through kv_b_proj); off: absorbed for every step.
    mla_decompressed_prefill: bool = reg.MLA_DECOMPRESSED_PREFILL.field()
    pdl: bool = reg.PDL.field()
    cpu_linear: str = "auto"  # CPU float32 GEMMs: auto = oneDNN with packed weights when available; torch = F.linear
    tp_size: int = reg.TP_SIZE.field()  # rank 0 launches the others (common/engine/tp_ranks.py)
    tp_rank: int = 0  # set by rank 0 for its followers
    tp_port: int = 0  # rank 0's TCPStore port (followers)
    tp_shm: str = ""  # shared-memory path prefix of the CPU ranks' KV pools (followers)
    tp_same_device: bool = False  # GPU: every rank on cfg.device, collectives via the host (checks on one GPU)
    # How other workers reach the ranks' KV: "shared" (rank 0 registers all pools), "per-rank" (an agent per rank).
    tp_transfer: str = reg.TP_TRANSFER.field()
    tp_agent_name: str = ""  # per-rank: rank 0's NIXL agent name; follower r's agent is "<name>-r<r>"
    # The module each follower process runs (common/worker/tp_follower.py gives each rank a NIXL agent).
    tp_follower_main: str = "common.engine.tp_follower"


@dataclass
class SchedulerConfig(reg.EnvFields):
    max_prefill_tokens: int = reg.MAX_PREFILL_TOKENS.field()
    enable_prefix_cache: bool = True
    # ITL target of stall-free batching (common/sched/prefill_budget.py): ITL_TARGET_SLO the SLO classes'; < 0:
    # -itl_target_ms measured decode steps; > 0: milliseconds; 0: prefill-first.
    itl_target_ms: float = reg.ITL_TARGET_MS.field()
    itl_delivery_ms: float = reg.ITL_DELIVERY_MS.field()  # of an SLO ITL target, left to the relay
    grammar_compile_timeout_s: float = reg.GRAMMAR_COMPILE_TIMEOUT_S.field()  # then the request fails alone
    max_step_ms: float = reg.MAX_STEP_MS.field()  # no planned step longer (commands wait between steps)
    slo_classes: str = reg.SLO_CLASSES.field()
    slo_default_class: str = reg.SLO_DEFAULT_CLASS.field()
    # GiB of host memory behind the prefix cache; 0: none; negative: chosen at start.
    host_kv_gb: float = reg.HOST_KV_GB.field()
    # auto: overlap on a GPU at TP=1, off otherwise; on | off force it (on: the GPU loop's shape on the CPU).
    overlap: str = reg.OVERLAP.field()
    kv_reservation: str = reg.KV_RESERVATION.field()
    preempt_mode: str = reg.PREEMPT_MODE.field()  # recompute | park (the host tier) | auto
    step_trace: str = reg.STEP_TRACE.field()  # a JSON-lines file of timed steps ("": off)

    @property
    def mixed_batching(self) -> bool:
        """Prompt chunks share steps with decode rows (any ITL target); False: prefill-first."""
        return self.itl_target_ms != 0


@dataclass(frozen=True)
class HttpLimits(reg.EnvFields):
    """What one HTTP request and connection may cost (`KVFERRY_HTTP_*`; docs/reliability.md, "HTTP limits")."""

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
