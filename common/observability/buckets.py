"""Histogram bucket edges shared by the router's and the workers' metrics (one set, so dashboards compare)."""

from __future__ import annotations

# Request latencies: TTFT and end-to-end span a millisecond (a cached short prompt on a GPU) to minutes
# (a long generation on a loaded CPU worker).
LATENCY_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
# Per-token and per-step times: tens of microseconds (a batched GPU decode step) to seconds (a CPU step
# under load).
STEP_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Token counts (prompt and output lengths, prefix hits).
TOKENS = tuple(float(2**k) for k in range(0, 18)) + (200_000.0,)  # 1 .. 131072, then the largest contexts
# Batch sizes of one engine step.
BATCH = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0)
# Bytes of one request's KV transfer: a page of a small model (tens of KB) to a long prompt on a large
# one (GBs).
BYTES = tuple(float(4**k * 1024) for k in range(0, 13))  # 1 KiB .. 16 GiB
# Achieved transfer speed, GB/s (10^9 bytes): TCP between pods (~1) to NVLink (~900).
GBPS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0, 800.0, 1600.0)
