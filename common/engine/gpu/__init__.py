"""The GPU path of the engine: flashinfer attention and CUDA-graph decode around the one model forward.

Nothing here is imported unless a `ModelRunner` selects the flashinfer backend (a CUDA device with a
16-bit dtype), so CPU-only machines never import flashinfer. The forward is `DecoderModel.forward` with
flashinfer's fused kernels as its ops (`FlashInferOps`, common/engine/layers.py). Modules:
- `attention`: `FlashInferAttention`, the `AttentionBackend` over flashinfer's paged prefill/decode wrappers;
- `cuda_graph`: decode steps captured as CUDA graphs at a ladder of batch sizes;
- `path`: `GpuPath`, which ties them together for `ModelRunner.forward`.
"""
