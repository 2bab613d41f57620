"""Batched sampling with per-request parameters, reproducible per request.

Random draws hash (request seed, output step, vocab id) and pick by Gumbel-max, so a seeded request samples
the same tokens whatever batch it shares, on CPU and GPU alike, with no generator objects and no host sync.
Logit adjustments are built only when some row asks for them. Penalties touch only the logits at a row's
history ids (gathered, penalised, scattered back), which equals the dense [B, V] formula bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.protocol import SamplingParams, replace

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer on int64 holding [0, 2^32): products wrap, but their low 32 bits stay exact."""
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
    # 23 bits: with 24 the top value rounds to 1.0, whose Gumbel noise is +inf (a masked token would give NaN).
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


# How `slot_values` lays out one request's parameters (per-row device tensors keep this layout).
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
INT_PARAMS = ("top_k", "seed")


def slot_values(p: SamplingParams, seed: int, vocab: int) -> tuple[tuple[float, ...], tuple[int, int]]:
    """A request's sampling parameters as the sampler reads them (greedy: temperature 0; top_k off: `vocab`)."""
    temp = 0.0 if p.greedy else p.temperature
    top_k = vocab if p.top_k <= 0 else min(p.top_k, vocab)
    return (temp, p.top_p, p.min_p, p.frequency_penalty, p.presence_penalty, p.repetition_penalty), (top_k, seed)


@dataclass(frozen=True)
class BatchFlags:
    """What a batch's requests ask for, decided on the host: which parts of sampling run at all."""

    all_greedy: bool
    needs_filter: bool
    needs_penalty: bool  # frequency or presence penalty
    repetition: bool
    max_top_logprobs: int
    want_logprobs: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int) -> BatchFlags:
        return cls(
            all_greedy=all(p.greedy for p in params),
            needs_filter=any((0 < p.top_k < vocab) or p.top_p < 1.0 or p.min_p > 0.0 for p in params),
            needs_penalty=any(p.frequency_penalty or p.presence_penalty for p in params),
            repetition=any(p.repetition_penalty != 1.0 for p in params),
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
            want_logprobs=any(p.logprobs or p.top_logprobs > 0 for p in params),
        )


@dataclass
class PenaltyView:
    """The penalty history a batch reads, in place: row `rows[b]` of the tables holds batch row b's history."""

    ids: torch.Tensor  # [R, C] int64: each table row's history ids, padded by repeating one of them
    counts: torch.Tensor | None  # [R, V] float32: output count of each token id (with frequency or presence)
    rows: torch.Tensor  # [B] int64: each batch row's table row
    width: int  # the window read: ids[rows[b], :width] (every row's history fits)

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = self.ids[:, : self.width].index_select(0, self.rows)
        if self.counts is None:
            return ids, None
        vocab = self.counts.shape[1]
        return ids, self.counts.view(-1).take(self.rows[:, None] * vocab + ids)


@dataclass
class SamplingBatch:
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
    # Penalties, read at each row's history ids (rows with penalties off may hold any ids).
    history: PenaltyView | None = None
    repetition_penalty: torch.Tensor | None = None  # [B] float32 (1 = off), with `history`
    # Sparse additions to the logits: logit_bias entries, and -inf for banned (row, token) pairs.
    add_rows: torch.Tensor | None = None  # [N] int64
    add_cols: torch.Tensor | None = None  # [N] int64
    add_vals: torch.Tensor | None = None  # [N] float32
    allowed_bits: torch.Tensor | None = None  # [B, ceil(grammar_vocab / 32)] int32 grammar bitmask, on `grammar_rows`
    grammar_rows: list[int] | torch.Tensor | None = None  # rows under a grammar (host ints, or int32 on a GPU)
    grammar_vocab: int = 0  # ids the bitmask covers (the tokenizer's; 0: all): the rest are banned on grammar rows

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        vocab: int,
        device: torch.device,
        steps: Sequence[int],
        prompts: Sequence[Sequence[int]] = (),
        outputs: Sequence[Sequence[int]] = (),
        eos_ids: Sequence[int] = (),
        grammar_done: Sequence[bool] = (),
    ) -> SamplingBatch:
        """`steps`: output tokens before this step (the noise's counter; with `min_tokens`, which rows still ban
        their stop ids unless `grammar_done`). `prompts` and `outputs`: each row's ids the penalties read."""
        flags = BatchFlags.of(params, vocab)
        step_list = list(steps)
        history = None
        if flags.needs_penalty or flags.repetition:
            rows = [
                [*(prompts[i] if i < len(prompts) else ()), *(outputs[i] if i < len(outputs) else ())]
                for i in range(len(params))
            ]
            params = [p if h else replace(p, **NO_PENALTY) for p, h in zip(params, rows)]
            ids = padded_history(rows)
            counts = token_counts([outputs[i] if i < len(outputs) else () for i in range(len(params))], vocab)
            history = PenaltyView(
                ids.to(device), counts.to(device), torch.arange(len(params), device=device), ids.shape[1]
            )
        floats, ints = zip(*(slot_values(p, seed, vocab) for p, seed in zip(params, seeds)))
        f = torch.tensor(floats, dtype=torch.float32, device=device).view(-1, len(FLOAT_PARAMS))
        i = torch.tensor(ints, dtype=torch.int64, device=device).view(-1, len(INT_PARAMS))
        add = sparse_additions(params, step_list, eos_ids, grammar_done)
        return cls.from_slots(
            f,
            i,
            torch.tensor(step_list, dtype=torch.int64, device=device),
            flags,
            history,
            *((None, None, None) if add is None else (t.to(device) for t in add)),
        )

    @classmethod
    def from_slots(
        cls,
        floats: torch.Tensor,
        ints: torch.Tensor,
        steps: torch.Tensor,
        flags: BatchFlags,
        history: PenaltyView | None = None,
        add_rows: torch.Tensor | None = None,
        add_cols: torch.Tensor | None = None,
        add_vals: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """From per-row parameters laid out as `slot_values` does (column views, no copies)."""
        col = {name: floats[:, k] for k, name in enumerate(FLOAT_PARAMS)}
        col.update({name: ints[:, k] for k, name in enumerate(INT_PARAMS)})
        return cls(
            temperature=col["temperature"],
            top_k=col["top_k"],
            top_p=col["top_p"],
            min_p=col["min_p"],
            seeds=col["seed"],
            steps=steps,
            frequency_penalty=col["frequency_penalty"],
            presence_penalty=col["presence_penalty"],
            all_greedy=flags.all_greedy,
            needs_filter=flags.needs_filter,
            needs_penalty=flags.needs_penalty,
            max_top_logprobs=flags.max_top_logprobs,
            want_logprobs=flags.want_logprobs,
            history=_penalty_view(history, flags),
            repetition_penalty=col["repetition_penalty"] if flags.repetition else None,
            add_rows=add_rows,
            add_cols=add_cols,
            add_vals=add_vals,
        )

    @property
    def adjusts_logits(self) -> bool:
        return self.history is not None or self.add_rows is not None or self.allowed_bits is not None


def _penalty_view(history: PenaltyView | None, flags: BatchFlags) -> PenaltyView | None:
    if history is None or not (flags.needs_penalty or flags.repetition):
        return None
    if flags.needs_penalty or history.counts is None:
        return history
    return PenaltyView(history.ids, None, history.rows, history.width)


NO_PENALTY = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


def padded_history(history: Sequence[Sequence[int]]) -> torch.Tensor:
    """[B, W] int64 on the host: each row's ids, padded to the longest by repeating its first (0 if none)."""
    width = max((len(h) for h in history), default=0)
    rows = [[*h, *([h[0] if h else 0] * (width - len(h)))] for h in history]
    return torch.tensor(rows, dtype=torch.int64).view(len(history), width)


def token_counts(ids: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """[B, V] float32 on the host: how often each token occurs in each row's ids."""
    counts = torch.zeros(len(ids), vocab, dtype=torch.float32)
    lens = torch.tensor([len(o) for o in ids], dtype=torch.int64)
    if int(lens.sum()) > 0:
        rows = torch.repeat_interleave(torch.arange(len(ids)), lens)
        cols = torch.tensor([t for o in ids for t in o], dtype=torch.int64)
        counts.index_put_((rows, cols), torch.ones_like(cols, dtype=torch.float32), accumulate=True)
    return counts


def sparse_additions(
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    eos_ids: Sequence[int],
    grammar_done: Sequence[bool],
    candidates: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, cols, values) to add to the logits: logit_bias, and -inf on stop ids while short of min_tokens
    (None when no row needs either); `candidates`: the only rows that may."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i in range(len(params)) if candidates is None else candidates:
        p, step = params[i], steps[i]
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            cols += p.logit_bias.keys()
            vals += p.logit_bias.values()
        if step < p.min_tokens and not (i < len(grammar_done) and grammar_done[i]):
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            rows += [i] * len(banned)
            cols += banned
            vals += [float("-inf")] * len(banned)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(cols, dtype=torch.int64),
        torch.tensor(vals, dtype=torch.float32),
    )


def adjust_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The logits every later step (greedy, temperature, filters) sees; a new tensor when anything applies."""
    raw = logits
    if sb.history is not None:
        logits = _penalize(logits, sb)
    if sb.add_rows is not None:
        # In place unless the raw logits still give logprobs: a copy cost all of [B, V] every such step.
        vocab = logits.shape[-1]
        index = sb.add_rows * vocab + sb.add_cols
        if (logits is raw and sb.want_logprobs) or not logits.is_contiguous():
            logits = logits.reshape(-1).scatter_add(0, index, sb.add_vals).view(logits.shape)
        else:
            logits.view(-1).scatter_add_(0, index, sb.add_vals)
    if sb.allowed_bits is not None:
        # xgrammar masks the grammar rows in place: on a copy only if the raw logits still give logprobs.
        from xgrammar import apply_token_bitmask_inplace

        if logits is raw and sb.want_logprobs:
            logits = logits.clone()
        vocab = logits.shape[-1]
        covered = min(sb.grammar_vocab or vocab, vocab)
        apply_token_bitmask_inplace(logits, sb.allowed_bits, vocab_size=covered, indices=sb.grammar_rows)
        if covered < vocab:  # an LM head padded past the tokenizer: no grammar allows those ids
            if sb.grammar_rows is None:
                logits[:, covered:] = float("-inf")
            else:
                rows = torch.as_tensor(sb.grammar_rows).to(logits.device, torch.int64)
                logits[:, covered:].index_fill_(0, rows, float("-inf"))
    return logits


def _penalize(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The penalties at each row's history ids, in the dense formula's float32 order (one kernel on a GPU)."""
    view = sb.history
    assert view is not None
    if logits.is_cuda:
        from common.engine.gpu.penalty import penalize  # Triton: imported only on a GPU

        out = logits.clone() if sb.want_logprobs or logits.stride(1) != 1 else logits
        penalize(
            out, view.ids, view.counts, view.rows, view.width, sb.repetition_penalty, sb.frequency_penalty,
            sb.presence_penalty,
        )  # fmt: skip
        return out
    ids, counts = view.gathered()
    raw = logits.gather(1, ids)
    value = raw
    if sb.repetition_penalty is not None:
        # Divide a positive logit, multiply a negative one: both make a seen token less likely (penalty > 1).
        p = sb.repetition_penalty[:, None]
        value = torch.where(raw > 0, raw / p, raw * p)
    if counts is not None:
        value = value - sb.frequency_penalty[:, None] * counts - sb.presence_penalty[:, None] * (counts > 0)
    # An id repeated in a row writes the same value each time (all from its one original logit).
    return logits.scatter(1, ids, value) if sb.want_logprobs else logits.scatter_(1, ids, value)


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
    # top-p: drop a token once the mass strictly before it reaches p (the top token always stays).
    before = probs.cumsum(dim=-1) - probs
    remove |= before >= sb.top_p[:, None]
    remove |= probs < (sb.min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of `[B, V]` rows (a few rows on a GPU: common/engine/gpu/argmax.py, chunked per row)."""
    if x.is_cuda:
        from common.engine.gpu import argmax  # Triton: imported only on a GPU

        if argmax.fits(x):
            return argmax.argmax_rows(x)
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampleResult:
    """logits: [B, V] float32 raw (penalties and grammar masks may be written into them without logprobs)."""
    raw = logits
    if sb.adjusts_logits:
        logits = adjust_logits(logits, sb)
    greedy_tokens = argmax_rows(logits)
    if sb.all_greedy:
        tokens = greedy_tokens
    else:
        temp = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
        scaled = logits / temp[:, None]
        if sb.needs_filter:
            scaled = _filter(scaled, sb)
        gumbel = -torch.log(-torch.log(uniform_noise(sb.seeds, sb.steps, logits.shape[-1])))
        sampled = argmax_rows(scaled + gumbel)
        tokens = torch.where(sb.temperature > 0, sampled, greedy_tokens)
    chosen = top_ids = top_lp = None
    if sb.want_logprobs:
        logp = raw.log_softmax(dim=-1)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        if sb.max_top_logprobs > 0:
            top_lp, top_ids = logp.topk(sb.max_top_logprobs, dim=-1)
    return SampleResult(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_lp)
