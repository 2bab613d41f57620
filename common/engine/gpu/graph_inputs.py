"""What both kinds of captured step share: the static token buffers they read, and picking a captured size."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.forward_batch import ForwardBatch
from common.kv.pool import KVPool


def smallest_fit(sizes: list[int], n: int, what: str) -> int:
    """The smallest captured size that holds `n` (`sizes` ascending)."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{what} of {n} exceeds the largest captured size {sizes[-1] if sizes else 0}")


@dataclass
class GraphInputs:
    """Token ids, positions and KV write rows (KVPool.token_rows) of up to `len(input_ids)` tokens. Padding rows
    write their K/V to the pool's dummy page (one page past the allocator's range) at position 0."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_loc: torch.Tensor
    dummy_slot: int

    @classmethod
    def allocate(cls, tokens: int, pool: KVPool, dummy_page: int, device: torch.device) -> GraphInputs:
        dummy_slot = int(pool.token_rows(torch.tensor([dummy_page * pool.layout.page_size]))[0])
        return cls(
            input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(tokens, dtype=torch.int64, device=device),
            out_loc=torch.full((tokens,), dummy_slot, dtype=torch.int64, device=device),
            dummy_slot=dummy_slot,
        )

    def load(self, batch: ForwardBatch, pool: KVPool, padded: int) -> None:
        """The batch's tokens first, then padding rows up to `padded`."""
        t = batch.num_tokens
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.out_loc[:t].copy_(pool.token_rows(batch.out_loc))
        if padded > t:
            self.out_loc[t:padded].fill_(self.dummy_slot)
            self.positions[t:padded].zero_()
