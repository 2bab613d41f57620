"""Prompt logprobs (vLLM's `prompt_logprobs`, completions' echo with logprobs): each prompt token's logprob given
the tokens before it, computed in the prefill's own chunks for the requests that ask.

A chunk covering positions [s, e) of a scored prompt has its LM head run over its positions s .. min(e, L-1)-1
as well as the last one (common/engine/runner.py, `score_lens`): position p's logits give token p+1's logprob,
so every chunk scores its own tokens' successors and no state crosses chunks. Memory is one chunk's logits
(chunk tokens x vocabulary floats), log-softmaxed in place in float32."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sched.launched import copy_to_host
from common.sched.request import Req


def score_len(req: Req, start: int, tokens: int) -> int:
    """Positions of a chunk of `tokens` tokens from `start` whose successor is a prompt token (0: not scored)."""
    if not req.scores_prompt:
        return 0
    return max(0, min(start + tokens, req.prompt_len - 1) - start)


@dataclass(eq=False)
class PromptScores:
    """One step's scored positions, request after request, on their way to the host."""

    reqs: list[Req]
    counts: list[int]
    logprobs: torch.Tensor  # [P] float32: each target token's logprob
    ranks: torch.Tensor  # [P] int64: 1 + the tokens strictly likelier than it
    top_ids: torch.Tensor | None  # [P, N] int64 (None: no request asked for alternatives)
    top_logprobs: torch.Tensor | None  # [P, N] float32

    @classmethod
    def compute(cls, logits: torch.Tensor, reqs: list[Req], starts: list[int], counts: list[int]) -> PromptScores:
        """`logits`: [sum(counts), V] float32, the scored positions in order; consumed (overwritten in place)."""
        ids: list[int] = []
        for r, s, k in zip(reqs, starts, counts):
            ids += r.prompt_ids[s + 1 : s + 1 + k]
        targets = torch.tensor(ids, dtype=torch.int64).to(logits.device, non_blocking=True)
        logp = logits.sub_(logits.logsumexp(-1, keepdim=True))
        chosen = logp.gather(1, targets[:, None])
        ranks = (logp > chosen).sum(-1) + 1
        n = max(r.sampling.prompt_logprobs or 0 for r in reqs)
        top_lp, top_ids = logp.topk(n, dim=-1) if n else (None, None)
        return cls(
            reqs,
            counts,
            copy_to_host(chosen[:, 0]),  # type: ignore[arg-type]
            copy_to_host(ranks),  # type: ignore[arg-type]
            copy_to_host(top_ids),
            copy_to_host(top_lp),
        )

    def deliver(self) -> None:
        """Appends each request's positions to its `prompt_logprobs` (once the step is done on the device)."""
        lps, ranks = self.logprobs.tolist(), self.ranks.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_lp = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        at = 0
        for r, k in zip(self.reqs, self.counts):
            out = r.prompt_logprobs
            if out is not None and not r.finished:
                out.logprobs += lps[at : at + k]
                out.ranks += ranks[at : at + k]
                n = r.sampling.prompt_logprobs or 0
                if n and top_ids is not None and top_lp is not None:
                    out.top_ids += [row[:n] for row in top_ids[at : at + k]]
                    out.top_logprobs += [row[:n] for row in top_lp[at : at + k]]
            at += k
