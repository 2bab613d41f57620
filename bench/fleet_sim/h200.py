"""The simulated worker for dummy Llama-3.1-8B bf16 on one H200: the step-time coefficients the engine's own
fit gives over the H200 microbenchmarks, and the three serving constants fitted to one recorded point, as
bench/fleet_sim/calibrate.py printed them (bench/RESULTS.md, "Fleet simulator"; rerun it to refresh)."""

from __future__ import annotations

from bench.fleet_sim.worker import WorkerSpec
from common.capacity import StepCost

__all__ = ["H200_LLAMA8B"]

H200_LLAMA8B = WorkerSpec(
    cost=StepCost(
        base_s=0.004142,
        per_prefill_token_s=2.1049e-05,
        per_decode_row_s=1.6300e-05,
        per_context_token_s=3.3554e-08,
        per_attention_pair_s=1.1208e-09,
    ),
    host_s=0.000623,
    spread_s=0.00687,
    kv_tokens=55346 * 16,
    # a prefill and a decode worker time-sharing one H200: their KV moves by a device-local copy (bench/transfer.py)
    local_transfer_base_s=0.000695,
    local_transfer_tokens_per_s=5.93e6,
    # and how they share the GPU: equal shares. The kernel-length model fitted to bench/gpu_share.py (weight 0.45,
    # exponent 1) predicted the served pair worse (TTFT -36 to -54%, bench/RESULTS.md): that microbenchmark waits
    # on every step, the engine overlaps them; its overlapped run (`--overlap`) is what decides. Time slices fitted to
    # the same loops (share_slice_s, bench/RESULTS.md "Time slices in the simulator") get the tail at the highest
    # rate only and over-predict it 2x at the lowest: not used here either.
    prefill_share_weight=1.0,
    share_length_exponent=0.0,
    # the engine's step loop on a GPU (bench/RESULTS.md, "The engine's launch ahead in the simulator"): the planner's
    # results moved by at most 0.05 points of attainment and 0.6% of GPU-hours with it
    launch_ahead=True,
    notice_after_step=True,
)
NET_S = 0.01027  # a first token's time outside the engine (router, HTTP, tokenizing)
