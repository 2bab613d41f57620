"""FP8 (e4m3) on the CPU twin, on the real packaged SmolLM2: the KV cache in FP8 pages, and FP8 linear weights
(quantized at load, or read from a compressed-tensors checkpoint), each against the float32 reference.

Tolerances, measured on this model and fixed prompt (float32 reference = the default CPU engine):
- FP8 KV: teacher-forced logits within 15% relative (L2) error (measured ~10%), the negative log-likelihood of
  the prompt within 3% (measured +1.1%), and at least half of the greedy tokens of four prompts equal to
  float32's (counted up to each prompt's first difference; measured 63 of 96, one prompt parting at a near-tie).
- FP8 weights (per-channel weight scales, per-token activation scales; this 135M model is more sensitive to
  8-bit GEMMs than 8B ones): logits within 25% (measured ~17%), NLL within 12% (measured +5.7% on one install,
  +8.1% on another with the same code, c0af712 included, whose packages were installed a day later: the prompt
  is 29 tokens, so a token or two moves the mean by points; the accuracy target itself is measured over 6,000
  tokens by bench/fp8_nll.py: +0.66% vs float32 on the first install, +0.48% on the second, argmax agreement
  0.881 and 0.886), and 30% of the greedy tokens (measured 34 of 96 on the second install, each prompt's
  tokens counted up to its first difference: 10, 5, 5 and 14 of 24). A compressed-tensors checkpoint written from it (FP8 weights, FP8 KV, bf16 embeddings and
  norms, all at once) within 30% / 10%, and 30% of the greedy tokens (measured 44 of 96).
Both are deterministic: the same request twice gives the same tokens (FP8 KV: also when its prompt is
prefilled in chunks over the cached FP8 pages instead of in one step).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.engine.runner import ModelRunner, RunnerConfig
from common.protocol import SamplingParams
from tests.engine_helpers import assert_pool_clean, fresh_engine

TEXT = (
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "Translate to French: The quick brown fox"
)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors of the rainbow:"]
# (logits relative L2 error, NLL relative increase) allowed: KV in FP8, GEMM weights and activations in FP8.
KV_TOLERANCE = (0.15, 0.03)
WEIGHT_TOLERANCE = (0.25, 0.12)
CHECKPOINT_TOLERANCE = (0.3, 0.1)  # FP8 weights, FP8 KV and the checkpoint's bf16 embeddings and norms together
MIN_GREEDY_AGREEMENT = 0.5  # share of the greedy tokens (leading, per prompt) equal to float32's


def nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean negative log-likelihood of `ids[1:]` under teacher-forced `logits` [len(ids), vocab]."""
    return F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])).item()


def agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def fp8_kv_runner(smol_runner):
    """The packaged model's float32 weights over an FP8 KV pool."""
    cfg = RunnerConfig(model=smol_runner.cfg.model, num_pages=512, max_running=8, kv_dtype="fp8_e4m3")
    return ModelRunner(cfg, model=smol_runner.model)


def compare_to_float32(
    runner: ModelRunner,
    smol_runner: ModelRunner,
    smol_tokenizer,
    tolerance: tuple[float, float],
    chunked: bool = False,
    min_greedy: float = MIN_GREEDY_AGREEMENT,
) -> None:
    ids = smol_tokenizer.encode(TEXT)
    ref = fresh_engine(smol_runner).score(ids)
    ours = fresh_engine(runner).score(ids)
    rel = ((ours - ref).norm() / ref.norm()).item()
    nll_ref, nll_ours = nll(ref, ids), nll(ours, ids)
    print(f"logits rel err {rel:.4f}, NLL {nll_ours:.4f} vs float32 {nll_ref:.4f}")
    assert rel < tolerance[0]
    assert nll_ours < nll_ref * (1 + tolerance[1])
    prompts = [smol_tokenizer.encode(p) for p in (*PROMPTS, TEXT)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    ref_out = [r.output_ids for r in fresh_engine(smol_runner).generate(prompts, sp)]
    engine = fresh_engine(runner)
    first = [r.output_ids for r in engine.generate(prompts, sp)]
    assert_pool_clean(engine)
    agree = [agreement(a, b) for a, b in zip(first, ref_out)]
    print(f"greedy agreement with float32 (of 24): {agree}")
    assert sum(agree) >= min_greedy * 24 * len(prompts)
    # Stable: the same requests again, in the same steps, give the same tokens.
    again = fresh_engine(runner, prefix_cache=False)
    assert [r.output_ids for r in again.generate(prompts, sp)] == first
    assert_pool_clean(again)
    if chunked:
        # Prefilled in 16-token chunks over cached FP8 pages, so in other steps beside other rows: as close as
        # the first run is to float32, not exact. A K or V computed by a GEMM of another shape may differ in its
        # last float32 bit and round to a neighbouring FP8 value: a prompt of 6 tokens, prefilled alone here, had
        # logprobs 0.057 apart and swapped a near-tie at its 14th token on torch 2.13's CPU kernels.
        chunked_engine = fresh_engine(runner, max_prefill_tokens=16, prefix_cache=False)
        chunked_out = [r.output_ids for r in chunked_engine.generate(prompts, sp)]
        assert_pool_clean(chunked_engine)
        agree = [agreement(a, b) for a, b in zip(chunked_out, first)]
        print(f"greedy agreement of chunked prefill with the first run (of 24): {agree}")
        assert sum(agree) >= min_greedy * 24 * len(prompts)


def test_fp8_kv_pool_is_half_of_bf16_and_close_to_float32(fp8_kv_runner, smol_runner, smol_tokenizer):
    layout = fp8_kv_runner.layout
    assert fp8_kv_runner.pool.kv.dtype == torch.float8_e4m3fn
    assert layout.bytes_per_token == layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim  # 1 B (bf16: 2)
    assert layout.bytes_per_token * 4 == smol_runner.layout.bytes_per_token  # float32
    compare_to_float32(fp8_kv_runner, smol_runner, smol_tokenizer, KV_TOLERANCE, chunked=True)


@pytest.fixture(scope="module")
def fp8_weights_runner(smol_runner):
    """The packaged model with its GEMM weights quantized to FP8 at load (KVFERRY_WEIGHT_DTYPE=fp8_e4m3)."""
    return ModelRunner(RunnerConfig(model=smol_runner.cfg.model, num_pages=512, max_running=8, weight_dtype="fp8_e4m3"))


def test_fp8_weights_quantized_at_load_are_close_to_float32(fp8_weights_runner, smol_runner, smol_tokenizer):
    model = fp8_weights_runner.model
    layer = model.layers[0]
    assert model.fp8_weights and layer.qkv_proj.dtype == torch.float8_e4m3fn
    assert layer.qkv_proj_scale.shape == (layer.qkv_proj.shape[0],)  # one scale per output channel
    assert model.embed.dtype == model.lm_head_weight.dtype == torch.float32  # embeddings and LM head stay
    dense = smol_runner.model.layers[0].qkv_proj
    err = (layer.packed["qkv_proj"].dequantize(torch.float32) - dense).norm() / dense.norm()
    assert err < 0.05  # e4m3 rounding: ~3% RMS
    compare_to_float32(fp8_weights_runner, smol_runner, smol_tokenizer, WEIGHT_TOLERANCE, min_greedy=0.3)


def write_compressed_tensors(src, dst, strategy: str, kv_scales: dict[str, float]) -> None:
    """A compressed-tensors FP8 checkpoint of the packaged model, as llm-compressor publishes them: every
    Linear but the (tied) LM head in e4m3 with `weight_scale` per tensor or per channel, a static
    `input_scale` per Linear, and static KV scales (`kv_cache_scheme`)."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            per_row = t.abs().amax(dim=1, keepdim=True) if strategy == "channel" else t.abs().amax().reshape(1)
            scale = (per_row / 448.0).float()
            out[name] = (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name + "_scale"] = scale
            out[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.05])
        else:
            out[name] = t.to(torch.bfloat16)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        for kv, value in kv_scales.items():
            out[f"model.layers.{i}.self_attn.{kv}_scale"] = torch.tensor(value)
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "input_activations": scheme}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
    }
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_checkpoint_loads(
    strategy, smol_path, smol_runner, fp8_weights_runner, smol_tokenizer, tmp_path
):
    ckpt = tmp_path / f"smol-fp8-{strategy}"
    write_compressed_tensors(smol_path, ckpt, strategy, {"k": 1.0, "v": 0.5})
    runner = ModelRunner(RunnerConfig(model=str(ckpt), num_pages=512, max_running=8, kv_dtype="fp8_e4m3"))
    model = runner.model
    assert model.fp8_weights and model.layers[3].gate_up_proj.dtype == torch.float8_e4m3fn
    assert runner.layout.kv_scales == (1.0, 0.5) * model.cfg.num_layers  # the checkpoint's, into the layout
    mine = fp8_weights_runner.model.layers[3]
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        loaded = getattr(model.layers[3], f"{name}_scale")
        if strategy == "channel":  # the same per-row quantization as at load: bit-equal
            assert torch.equal(getattr(model.layers[3], name).view(torch.uint8), getattr(mine, name).view(torch.uint8))
            torch.testing.assert_close(loaded, getattr(mine, f"{name}_scale"))
        else:  # one scale per projection, repeated over its rows: q, k, v (gate, up) keep their own when merged
            parts = {"qkv_proj": 3, "gate_up_proj": 2}.get(name, 1)
            assert loaded.unique().numel() == parts
    compare_to_float32(runner, smol_runner, smol_tokenizer, CHECKPOINT_TOLERANCE, min_greedy=0.3)


def write_fp8_method(src, dst, block: tuple[int, int] | None) -> None:
    """An FP8 checkpoint in the `quant_method: fp8` format of the packaged model: with `block`, as the FP8
    releases of Qwen3 and DeepSeek (e4m3 weights, a `weight_scale_inv` multiplier per block, the last blocks of
    a row or column partial where the size is not a multiple: SmolLM2's 576 is 4.5 blocks of 128); without, one
    `weight_scale` per tensor."""
    import json

    from safetensors.torch import load_file, save_file

    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not name.endswith("_proj.weight"):
            out[name] = t.to(torch.bfloat16)
            continue
        if block is None:
            scale = (t.abs().amax() / 448.0).float().reshape(1)
            out[name], out[name + "_scale"] = (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale
            continue
        n, k = t.shape
        rb, cb = -(-n // block[0]), -(-k // block[1])
        padded = torch.zeros(rb * block[0], cb * block[1])
        padded[:n, :k] = t.float()
        amax = padded.view(rb, block[0], cb, block[1]).abs().amax(dim=(1, 3))
        scale_inv = (amax.clamp(min=1e-12) / 448.0).float()
        full = scale_inv.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        out[name] = (t.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scale_inv
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        cfg["quantization_config"]["weight_block_size"] = list(block)
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block-128", "per-tensor"])
def test_fp8_method_checkpoint_loads(block, smol_path, smol_runner, smol_tokenizer, tmp_path):
    """`quant_method: fp8` checkpoints (Qwen3-FP8's 128 x 128 block scales; older per-tensor exports) load as FP8
    weights with one scale per output row, each within e4m3's rounding of the checkpoint's own weights, and serve
    within the FP8-weights tolerance of float32."""
    from common.engine.weights import rows_from_blocks

    ckpt = tmp_path / f"smol-fp8-{'block' if block else 'tensor'}"
    write_fp8_method(smol_path, ckpt, block)
    runner = ModelRunner(RunnerConfig(model=str(ckpt), num_pages=512, max_running=8))
    layer = runner.model.layers[2]
    assert runner.model.fp8_weights and layer.down_proj.dtype == torch.float8_e4m3fn
    dense = smol_runner.model.layers[2].down_proj
    loaded = layer.down_proj.float() * layer.down_proj_scale[:, None]
    assert float((loaded - dense).norm() / dense.norm()) < 0.06  # e4m3 twice at most: ~3% RMS each
    compare_to_float32(runner, smol_runner, smol_tokenizer, WEIGHT_TOLERANCE, min_greedy=0.3)
    # Blocks of one row sharing a scale, rows that reach e4m3's 448: the same values, bit for bit; a scale grid that
    # misses the weight is refused.
    w = (torch.randn(200, 300) * 3).clamp(-400, 400)
    w[:, 7] = 448.0
    w = w.to(torch.float8_e4m3fn)
    wq, ws = rows_from_blocks(w, torch.full((2, 3), 0.5), (128, 128))
    assert torch.equal(wq.float() * ws, w.float() * 0.5)
    with pytest.raises(ValueError, match="do not cover"):
        rows_from_blocks(w, torch.ones(1, 3), (128, 128))


def test_unsupported_quantization_is_refused(smol_path, tmp_path):
    import json
    import shutil

    ckpt = tmp_path / "smol-int4"
    ckpt.mkdir()
    shutil.copy(smol_path / "model.safetensors", ckpt / "model.safetensors")
    cfg = json.loads((smol_path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}},
    }
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="only FP8"):
        ModelRunner(RunnerConfig(model=str(ckpt), num_pages=64, max_running=2))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="e4m3 is"):
        ModelRunner(RunnerConfig(model=str(ckpt), num_pages=64, max_running=2))


def test_host_tier_keeps_fp8_pages_byte_for_byte():
    """The host tier holds FP8 pages as the device pool does (one byte per value, half a bf16 page) and copies
    them both ways unchanged."""
    from common.engine.fp8 import to_fp8
    from common.kv.host_tier import HostTier
    from common.kv.pool import KVLayout, KVPool

    fp8 = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float8_e4m3fn)
    bf16 = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    pool = KVPool(fp8, 12)
    pool.kv.copy_(to_fp8(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(1)) * 8))
    tier = HostTier(pool, 6)
    assert tier.pool.kv.dtype == torch.float8_e4m3fn
    assert 2 * tier.pool.page_stride_bytes == KVPool(bf16, 1).page_stride_bytes
    before = pool.kv[[2, 3, 7]].view(torch.uint8).clone()
    tier.save(torch.tensor([2, 3, 7]), torch.tensor([0, 1, 4]))
    pool.kv.view(torch.uint8)[[2, 3, 7]] = 0
    tier.load(torch.tensor([0, 1, 4]), torch.tensor([9, 10, 11]))
    assert torch.equal(pool.kv[[9, 10, 11]].view(torch.uint8), before)


def test_fp8_activation_quantization_off_the_gpu_quantizes_the_unfused_ops_output():
    """The GPU path's fused norm/SiLU-mul + quantize entry points (common/engine/gpu/fp8_kernels.py) on tensors
    without CUDA compose the 16-bit ops with `quantize_rows`, with the residual stream updated in place, as the
    Triton kernels do on the GPU (tests/test_gpu_kernels.py holds those to flashinfer's ops)."""
    from common.engine.fp8 import quantize_rows, to_fp8
    from common.engine.gpu import fp8_kernels
    from common.engine.layers import rms_norm, silu_and_mul

    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    res = (torch.randn(5, 64, generator=g) * 4).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(64, generator=g)).to(torch.bfloat16)

    def same(got, expected) -> None:
        assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8)) and torch.equal(got[1], expected[1])

    q, s, stream = fp8_kernels.add_rms_norm_quant(x, None, w, 1e-6)
    assert stream is x
    same((q, s), quantize_rows(rms_norm(x, w, 1e-6)))
    summed = res + x
    stream_in = res.clone()
    q, s, stream = fp8_kernels.add_rms_norm_quant(x, stream_in, w, 1e-6)
    assert stream is stream_in and torch.equal(stream, summed)
    same((q, s), quantize_rows(rms_norm(summed, w, 1e-6)))
    gate_up = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    same(fp8_kernels.silu_mul_quant(gate_up), quantize_rows(silu_and_mul(gate_up)))
    assert float(s.min()) > 0 and q.dtype == torch.float8_e4m3fn
    big = torch.tensor([1000.0, -1000.0, 3.3]).to(torch.bfloat16)
    assert torch.equal(fp8_kernels.saturate(big).float(), to_fp8(big).float())
    assert fp8_kernels.saturate(big).float().abs().max() == 448.0


def test_fp8_is_refused_before_loading_on_a_gpu_without_fp8(smol_path, monkeypatch):
    """A GPU older than Ada (an A100: compute capability 8.0) has no FP8 tensor cores and Triton has no e4m3 there:
    asking for FP8 weights or an FP8 KV cache fails at start with the reason, before any weight is read."""
    from common.engine.fp8 import fp8_unsupported

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fp8_unsupported(torch.device("cpu")) is None  # the CPU twin runs everywhere
    assert "8.9 or newer" in fp8_unsupported(torch.device("cuda"))
    for setting, fmt in (
        ("KVFERRY_KV_DTYPE", dict(kv_dtype="fp8_e4m3")),
        ("KVFERRY_WEIGHT_DTYPE", dict(weight_dtype="fp8_e4m3")),
    ):
        with pytest.raises(ValueError, match=f"{setting}=fp8_e4m3: FP8 needs a GPU of compute capability 8.9"):
            ModelRunner(RunnerConfig(model=str(smol_path), device="cuda", num_pages=64, max_running=2, **fmt))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_unsupported(torch.device("cuda")) is None


def test_fp8_checkpoint_serves_dequantized_where_fp8_cannot_run(
    smol_path, smol_runner, smol_tokenizer, tmp_path, monkeypatch
):
    """An FP8 checkpoint on a device without FP8 kernels still serves: its GEMM weights are dequantized at load to
    the model's dtype (the checkpoint's values exactly, at 16/32-bit memory cost), not refused."""
    import common.engine.runner as runner_module
    from common.engine.fp8 import Fp8Linear

    ckpt = tmp_path / "smol-fp8-tensor"
    write_fp8_method(smol_path, ckpt, None)
    fp8 = ModelRunner(RunnerConfig(model=str(ckpt), num_pages=64, max_running=2)).model.layers[1]
    monkeypatch.setattr(runner_module, "fp8_unsupported", lambda device: "no FP8 kernels here")
    runner = ModelRunner(RunnerConfig(model=str(ckpt), num_pages=512, max_running=8))
    layer = runner.model.layers[1]
    assert not runner.model.fp8_weights and layer.gate_up_proj.dtype == torch.float32
    assert not any(isinstance(w, Fp8Linear) for w in layer.packed.values())  # oneDNN-packed float32 on the CPU
    assert not hasattr(layer, "gate_up_proj_scale")
    assert torch.equal(layer.gate_up_proj, fp8.gate_up_proj.float() * fp8.gate_up_proj_scale[:, None])
    ids = smol_tokenizer.encode(TEXT)
    ref = fresh_engine(smol_runner).score(ids)
    ours = fresh_engine(runner).score(ids)
    assert ((ours - ref).norm() / ref.norm()).item() < WEIGHT_TOLERANCE[0]
    assert nll(ours, ids) < nll(ref, ids) * (1 + WEIGHT_TOLERANCE[1])
