"""The GPU path of the engine: flashinfer attention, fused kernels and CUDA-graph decode.

Nothing here is imported unless a `ModelRunner` selects the flashinfer backend (a CUDA device with a
16-bit dtype), so CPU-only machines never import flashinfer. Modules:
- `attention`: `FlashInferAttention`, the `AttentionBackend` over flashinfer's paged prefill/decode wrappers;
- `fused`: the decoder forward with flashinfer's RMSNorm, fused add-RMSNorm, RoPE and SiLU-and-mul;
- `cuda_graph`: decode steps captured as CUDA graphs at a ladder of batch sizes;
- `path`: `GpuPath`, which ties them together for `ModelRunner.forward`.
"""
