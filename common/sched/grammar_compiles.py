"""Grammars compiled off the step loop: a request whose grammar is not compiled yet waits here, outside the
waiting queue, while a worker thread compiles it (xgrammar releases the GIL, so steps go on meanwhile); it joins
the queue once compiled, or fails alone on a compile error or past its deadline.

A schema within the router's limits can still take seconds to compile (500 optional properties: ~1.5 s on one
CPU core); compiled on the loop, every stream of the worker would stall that long.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from common.protocol import GrammarSpec
from common.sched.grammar import GrammarBook, GrammarError
from common.sched.request import Req

COMPILE_THREADS = 1  # one compile at a time: xgrammar's compiler has threads of its own


@dataclass
class _Compiling:
    req: Req
    future: Future[Any]
    deadline: float  # time.monotonic()
    done_at: list[float] = field(default_factory=list)  # when the compile finished (set on its thread)

    def __post_init__(self) -> None:
        # The finish time, not the time of the loop's next look: a loop asleep past the deadline must not count
        # a late compile as in time.
        self.future.add_done_callback(lambda _f: self.done_at.append(time.monotonic()))


@dataclass
class GrammarCompiles:
    """Requests whose grammar compiles on the worker thread (`start`), collected once done (`collect`)."""

    book: GrammarBook
    timeout_s: float
    pending: dict[str, _Compiling] = field(default_factory=dict)
    _pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:  # made on first use: a worker that never sees a grammar starts no thread
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        return self._pool

    def prefetch(self, spec: GrammarSpec) -> Future[Any]:
        """Compiles `spec` into the book's cache on the worker thread (its result or GrammarError in the future)."""
        return self._executor().submit(self.book.compile, spec)

    def start(self, req: Req) -> None:
        assert req.sampling.grammar is not None
        deadline = time.monotonic() + self.timeout_s
        self.pending[req.req_id] = _Compiling(req, self.prefetch(req.sampling.grammar), deadline)

    def drop(self, req_id: str) -> Req | None:
        """Forgets a request (aborted): a compile under way finishes into the cache, harmlessly."""
        entry = self.pending.pop(req_id, None)
        return entry.req if entry is not None else None

    def collect(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests compiled, in arrival order; requests failed, with why). A deadline missed fails the request
        even though its compile goes on (it cannot be stopped; it fills the cache for the next one)."""
        if not self.pending:
            return [], []
        now = time.monotonic()
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        for rid, entry in list(self.pending.items()):
            if entry.future.done() and entry.done_at and entry.done_at[0] <= entry.deadline:
                del self.pending[rid]
                exc = entry.future.exception()
                if exc is None:
                    ready.append(entry.req)
                elif isinstance(exc, GrammarError):
                    failed.append((entry.req, str(exc)))
                else:
                    failed.append((entry.req, f"grammar compilation failed: {type(exc).__name__}: {exc}"))
            elif now > entry.deadline or entry.done_at:
                del self.pending[rid]
                failed.append((entry.req, f"the grammar did not compile within {self.timeout_s:g}s"))
        return ready, failed

    def __len__(self) -> int:
        return len(self.pending)
