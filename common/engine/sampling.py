"""Batched sampling with per-request parameters, reproducible per request.

Random draws come from a counter-based hash of (request seed, output step, vocab id) and the Gumbel-max
trick, so a seeded request samples the same tokens whatever batch it shares, on CPU and GPU alike, with
no per-request generator objects and no host sync inside the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.protocol import SamplingParams

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer on int64 tensors holding values in [0, 2^32). Products wrap in int64,
    but only their low 32 bits are kept, which wrapping leaves exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] uniforms in (0, 1) determined by (seed, step, vocab id) only."""
    device = seeds.device
    s = _mix32((seeds & _M32) ^ _mix32((seeds >> 32) & _M32))
    s = _mix32(s ^ ((steps * 0x9E3779B9) & _M32))
    ids = (torch.arange(vocab, device=device, dtype=torch.int64) * 0x85EBCA6B) & _M32
    h = _mix32(s[:, None] ^ ids[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingBatch:
    """Per-request sampling parameters of one step as tensors (built once per step)."""

    temperature: torch.Tensor  # [B] float32, 0 for greedy
    top_k: torch.Tensor  # [B] int64, vocab size when off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: output tokens produced so far
    frequency_penalty: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    all_greedy: bool
    needs_filter: bool
    needs_penalty: bool
    max_top_logprobs: int
    want_logprobs: bool
    output_counts: torch.Tensor | None = None  # [B, V] float32 token counts of each request's output

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        output_ids: list[list[int]],
        vocab: int,
        device: torch.device,
    ) -> SamplingBatch:
        temps = [0.0 if p.greedy else p.temperature for p in params]
        top_k = [vocab if p.top_k <= 0 else min(p.top_k, vocab) for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        needs_penalty = any(freq) or any(pres)
        counts = None
        if needs_penalty:
            counts = torch.zeros(len(params), vocab, dtype=torch.float32)
            lens = torch.tensor([len(o) for o in output_ids], dtype=torch.int64)
            if int(lens.sum()) > 0:
                rows = torch.repeat_interleave(torch.arange(len(params)), lens)
                cols = torch.tensor([t for o in output_ids for t in o], dtype=torch.int64)
                counts.index_put_((rows, cols), torch.ones_like(cols, dtype=torch.float32), accumulate=True)
            counts = counts.to(device)
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            temperature=torch.tensor(temps, **f32),
            top_k=torch.tensor(top_k, **i64),
            top_p=torch.tensor([p.top_p for p in params], **f32),
            min_p=torch.tensor([p.min_p for p in params], **f32),
            seeds=torch.tensor(seeds, **i64),
            steps=torch.tensor([len(o) for o in output_ids], **i64),
            frequency_penalty=torch.tensor(freq, **f32),
            presence_penalty=torch.tensor(pres, **f32),
            all_greedy=all(t == 0.0 for t in temps),
            needs_filter=any(k < vocab for k in top_k) or any(p.top_p < 1.0 or p.min_p > 0.0 for p in params),
            needs_penalty=needs_penalty,
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
            want_logprobs=any(p.logprobs or p.top_logprobs > 0 for p in params),
            output_counts=counts,
        )


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: log-probability of the chosen token (raw model distribution)
    top_ids: torch.Tensor | None  # [B, N]
    top_logprobs: torch.Tensor | None  # [B, N]


def _filter(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Masks tokens outside top-k / top-p / min-p with -inf (logits already temperature-scaled)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= sb.top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # top-p: drop a token when the mass strictly before it already reaches p (the top token always stays).
    before = probs.cumsum(dim=-1) - probs
    remove |= before >= sb.top_p[:, None]
    remove |= probs < (sb.min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampleResult:
    """logits: [B, V] float32 raw model logits."""
    raw = logits
    if sb.needs_penalty and sb.output_counts is not None:
        counts = sb.output_counts
        logits = logits - sb.frequency_penalty[:, None] * counts - sb.presence_penalty[:, None] * (counts > 0)
    greedy_tokens = logits.argmax(dim=-1)
    if sb.all_greedy:
        tokens = greedy_tokens
    else:
        temp = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
        scaled = logits / temp[:, None]
        if sb.needs_filter:
            scaled = _filter(scaled, sb)
        gumbel = -torch.log(-torch.log(uniform_noise(sb.seeds, sb.steps, logits.shape[-1])))
        sampled = (scaled + gumbel).argmax(dim=-1)
        tokens = torch.where(sb.temperature > 0, sampled, greedy_tokens)
    chosen = top_ids = top_lp = None
    if sb.want_logprobs:
        logp = raw.log_softmax(dim=-1)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        if sb.max_top_logprobs > 0:
            top_lp, top_ids = logp.topk(sb.max_top_logprobs, dim=-1)
    return SampleResult(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_lp)
