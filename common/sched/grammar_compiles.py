"""Grammars compiled off the step loop (a schema can take seconds, which would stall every stream): the request
waits outside the queue while a thread compiles it (xgrammar releases the GIL), then joins the queue, or fails
alone on an error or its deadline.
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
        # The finish time, not the loop's next look: a loop asleep past the deadline must not count a late compile in time.
        self.future.add_done_callback(lambda _f: self.done_at.append(time.monotonic()))


@dataclass
class GrammarCompiles:
    book: GrammarBook
    timeout_s: float
    pending: dict[str, _Compiling] = field(default_factory=dict)
    _pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:  # made on first use: a worker that never sees a grammar starts no thread
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        return self._pool

    def prefetch(self, spec: GrammarSpec) -> Future[Any]:
        """Compiles `spec` into the book's cache on the worker thread."""
        return self._executor().submit(self.book.compile, spec)

    def start(self, req: Req) -> None:
        assert req.sampling.grammar is not None
        deadline = time.monotonic() + self.timeout_s
        self.pending[req.req_id] = _Compiling(req, self.prefetch(req.sampling.grammar), deadline)

    def drop(self, req_id: str) -> Req | None:
        """Forgets an aborted request; a compile under way finishes into the cache, harmlessly."""
        entry = self.pending.pop(req_id, None)
        return entry.req if entry is not None else None

    def collect(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests compiled, in arrival order; requests failed, with why). A missed deadline fails the request;
        its compile goes on and fills the cache."""
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
