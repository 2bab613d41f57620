from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepInputs:
    """What a step is built from, as CPU tensors: tensor-parallel followers rebuild the same batch from these."""

    is_decode: bool
    input_ids: torch.Tensor  # [T] int64
    extend_lens: torch.Tensor  # [B] int64
    starts: torch.Tensor  # [B] int64: position of each request's first token in this step
    table_rows: torch.Tensor  # [B] int64
    sample_mask: torch.Tensor  # [B] bool: the request samples a token from this step
    all_logits: bool = False  # logits of every token (scoring), not just the sampled ones
    # [B] int64, or None: per request, its leading tokens whose logits are wanted too (prompt logprobs); their
    # rows follow the sampled ones in the logits, request after request.
    score_lens: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    """Everything one model step needs, built once per step by the model runner (tensor ops, no per-token loops).

    Tokens of all requests are packed back to back (`T` tokens in all, `B` requests). Request `i` owns
    tokens `q_start[i] : q_start[i] + extend_lens[i]`; its KV after the step spans `seq_lens[i]` tokens
    whose slots are `token_locs[i, :seq_lens[i]]` (raw pool locations from the page table).
    """

    is_decode: bool
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_loc: torch.Tensor  # [T] int64: pool slot where each token's K/V is written
    seq_lens: torch.Tensor  # [B] int64 (on the CPU as seq_lens_cpu too)
    extend_lens: torch.Tensor  # [B] int64
    q_start: torch.Tensor  # [B] int64
    table_rows: torch.Tensor  # [B] int64: page-table row of each request
    logits_indices: torch.Tensor  # [R] int64: token index (in T) whose logits are sampled, then scored ones
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    inputs: StepInputs | None = None
    scored_rows: int = 0  # trailing rows of the logits that score prompt positions (StepInputs.score_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)
