"""Run by tests/test_penalty_kernels.py under TRITON_INTERPRET=1 (Triton's interpreter, on the CPU): the GPU
penalty kernels against the torch path on random batches; prints one JSON line of results."""

from __future__ import annotations

import json
import random

import torch

from common.engine.gpu import penalty as kernels
from common.engine.sampling import SamplingBatch, adjust_logits
from common.protocol import SamplingParams

KINDS = {
    "all": [
        dict(),
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=-1.1),
        dict(frequency_penalty=-0.4, presence_penalty=0.9, repetition_penalty=1.1),
    ],
    "repetition only": [dict(repetition_penalty=1.2), dict(repetition_penalty=0.8), dict()],
    "counts only": [dict(frequency_penalty=0.7), dict(presence_penalty=0.4), dict()],
}


def penalize_cases() -> list[dict]:
    rng = random.Random(0)
    out = []
    for kind, kinds in KINDS.items():
        for batch, vocab, longest, logprobs in [(3, 50, 8, False), (6, 300, 700, True), (4, 1000, 1300, False)]:
            params = [SamplingParams(logprobs=logprobs, **rng.choice(kinds)) for _ in range(batch)]
            few = [rng.randrange(vocab) for _ in range(5)]  # many repeated ids
            prompts = [[rng.choice(few) for _ in range(rng.randrange(1, longest))] for _ in range(batch)]
            outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, longest))] for _ in range(batch)]
            steps = [len(o) for o in outputs]
            sb = SamplingBatch.build(params, [0] * batch, vocab, torch.device("cpu"), steps, prompts, outputs)
            if sb.history is None:
                continue
            logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(len(out))) * 4
            logits[:, 3::7] = 0.0
            want = adjust_logits(logits.clone(), sb)  # the torch path
            got = logits.clone()
            view = sb.history
            kernels.penalize(
                got, view.ids, view.counts, view.rows, view.width, sb.repetition_penalty, sb.frequency_penalty,
                sb.presence_penalty,
            )  # fmt: skip
            out.append({"kind": kind, "width": view.width, "equal": bool(torch.equal(got, want))})
    return out


def record_case() -> bool:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (300, 64), generator=g)
    counts = torch.randint(0, 3, (300, 100), generator=g).float()
    n = 200  # more rows than one program's block
    rows = torch.randperm(300, generator=g)[:n]
    start = torch.randint(-5, 20, (n,), generator=g)
    steps = torch.randint(5, 40, (n,), generator=g)
    tokens = torch.randint(0, 100, (n,), generator=g)
    want_ids, want_counts = ids.clone(), counts.clone()
    want_ids.index_put_((rows, start + steps), tokens)
    want_counts.view(-1).index_add_(0, rows * 100 + tokens, torch.ones(n))
    kernels.record(ids, counts, rows, start, steps, tokens)
    return bool(torch.equal(ids, want_ids) and torch.equal(counts, want_counts))


if __name__ == "__main__":
    print(json.dumps({"penalize": penalize_cases(), "record": record_case()}))
