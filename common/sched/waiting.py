"""The prompts waiting for prefill, in the order they are served: earliest TTFT deadline first.

A request's deadline is its arrival here plus its class's TTFT target (common/slo.py); a class without one
(batch) gets a patience of ten of the tightest target instead, so it gives way to interactive requests while
they are within their targets and is never starved. Within a class, deadlines follow arrival (first come,
first served); a tie across classes goes to the higher class.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from common.sched.request import Req

__all__ = ["WaitingQueue"]


class WaitingQueue:
    def __init__(self) -> None:
        self._keys: list[tuple[float, int, int]] = []
        self._reqs: list[Req] = []
        self._seq = itertools.count()

    def append(self, req: Req) -> None:
        key = (req.deadline_s, req.slo_rank, next(self._seq))
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, req)

    def popleft(self) -> Req:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def remove(self, req: Req) -> None:
        i = self._reqs.index(req)
        del self._keys[i], self._reqs[i]

    def tokens_before(self, deadline_s: float, rank: int) -> int:
        """Prompt tokens queued ahead of a request with this deadline and class rank (its place in the order,
        ties going to those already queued): what a new request of a class waits behind."""
        i = bisect.bisect(self._keys, (deadline_s, rank, float("inf")))
        return sum(r.prompt_len for r in self._reqs[:i])

    def __getitem__(self, i: int) -> Req:
        return self._reqs[i]

    def __iter__(self) -> Iterator[Req]:
        return iter(self._reqs)

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        return bool(self._reqs)
