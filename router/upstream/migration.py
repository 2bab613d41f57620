"""Requests survive their decode worker (docs/reliability.md, "Decode migration"): a lost stream continues on
another worker with the prompt plus every token received, the tokens left, and ``output_offset`` = the tokens
already out, so seeded sampling and penalties go on as an uninterrupted run would. At most ``limit`` times;
with no decode worker ready it waits up to ``wait_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from common.protocol import SamplingParams, TokenLine, replace
from router.decision.dispatch import Dispatcher, PromptPlan
from router.errors import OpenAIError
from router.upstream.call import UpstreamCall

log = logging.getLogger("kvferry.router")

__all__ = ["MIGRATIONS", "MigratingCall", "MigrationStats"]

_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)  # between tries while no decode worker is ready


@dataclass
class MigrationStats:
    """This router process's migration counters (``/router/workers``; ``kvferry_router_migrations_total``)."""

    started: int = 0  # continuations sent to a worker
    succeeded: int = 0  # continuations that produced their first event: the client's stream went on
    failed: int = 0  # choices that ended with an error: limit reached, or no worker within the wait

    def snapshot(self) -> dict[str, Any]:
        return asdict(self)


MIGRATIONS = MigrationStats()


class MigratingCall:
    """One choice's generation, moved whenever its worker is lost; UpstreamCall's interface, which runs each leg."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        req_id: str,
        plan: PromptPlan,
        sampling: SamplingParams,
        limit: int,
        wait_s: float,
    ) -> None:
        self.d = dispatcher
        self.req_id = req_id
        self.plan = plan
        self.sampling = sampling
        self.limit = limit
        self.wait_s = wait_s
        self.leg = UpstreamCall(dispatcher, req_id, plan, sampling)
        self.output_ids: list[int] = []  # every token received so far, over all legs
        self.migrations = 0
        self._failure: TokenLine | None = None  # a lost leg noticed by next_nowait, handled by next
        self._closed = False

    async def start(self) -> TokenLine:
        return self._seen(await self.leg.start())

    def next_nowait(self) -> TokenLine | None:
        if self._failure is not None:
            return None
        ev = self.leg.next_nowait()
        return None if ev is None else self._take(ev)

    async def next(self) -> TokenLine | None:
        while not self._closed:
            if self._failure is not None:
                failure, self._failure = self._failure, None
                return await self._migrate(failure)
            ev = await self.leg.next()
            if ev is None:
                return None
            taken = self._take(ev)
            if taken is not None:
                return taken
        return None

    async def aclose(self) -> None:
        self._closed = True
        await self.leg.aclose()

    def abandon(self) -> None:
        self._closed = True
        self.leg.abandon()

    def _count(self, outcome: str) -> None:
        setattr(MIGRATIONS, outcome, getattr(MIGRATIONS, outcome) + 1)
        self.d.metrics.migrations.labels(outcome=outcome).inc()  # kvferry_router_migrations_total

    def _seen(self, ev: TokenLine) -> TokenLine:
        self.output_ids.extend(ev.token_ids)
        return ev

    def _take(self, ev: TokenLine) -> TokenLine | None:
        """The event to hand on; None when the leg was lost and the choice migrates (its tokens handed on first)."""
        if ev.finish_reason != "error" or not ev.retryable:
            return self._seen(ev)
        if self.migrations >= self.limit:
            self._count("failed")
            ev.error = f"{ev.error}; not continued: this request already moved {self.migrations} times"
            return self._seen(ev)
        self._failure = ev
        if ev.token_ids:
            return self._seen(TokenLine(token_ids=ev.token_ids, logprobs=ev.logprobs))
        return None

    async def _migrate(self, failure: TokenLine) -> TokenLine:
        lost = self.leg
        avoid = lost.decision.decode if lost.decision is not None else None
        await lost.aclose()  # closing the stream aborts the request on the old worker, if it still lives
        remaining = self.sampling.max_tokens - len(self.output_ids)
        if remaining <= 0:  # every token arrived, only the finish was lost
            return TokenLine(finish_reason="length")
        prompt = (*self.plan.token_ids, *self.output_ids)
        # The prompt's logprobs came with the first leg's first line: the continuation computes none.
        sampling = replace(
            self.sampling, max_tokens=remaining, output_offset=len(self.output_ids), prompt_logprobs=None
        )
        plan = await self.d.plan(prompt)
        reason = failure.error or "worker lost"
        give_up_at = time.monotonic() + self.wait_s
        waits = 0
        while self.migrations < self.limit and not self._closed:
            self.migrations += 1
            self._count("started")
            leg = UpstreamCall(self.d, f"{self.req_id}-m{self.migrations}", plan, sampling)
            self.leg = leg
            try:
                first = await leg.start(avoid)
            except OpenAIError as exc:
                reason = exc.message
                if exc.status in (429, 503) and time.monotonic() < give_up_at:
                    # No decode worker ready or room (restarting, maybe): wait, without using up a try.
                    self.migrations -= 1
                    await asyncio.sleep(_BACKOFF_S[min(waits, len(_BACKOFF_S) - 1)])
                    waits += 1
                    avoid = None  # the lost worker may be back by now
                continue
            self._count("succeeded")
            log.warning(
                "stream continued on another decode worker",
                extra={
                    "req_id": self.req_id,
                    "migration": self.migrations,
                    "tokens_done": len(self.output_ids),
                    "lost": avoid,
                    "decode": leg.decision.decode if leg.decision is not None else None,
                    "reason": failure.error,
                },
            )
            first.prompt_tokens = 0  # usage counts the original prompt, not the continuation's
            first.cached_tokens = 0
            return self._take(first) or await self.next()
        if self._closed:  # the client left meanwhile: nobody reads this
            return TokenLine(finish_reason="abort")
        self._count("failed")
        return TokenLine(
            finish_reason="error",
            error=f"{failure.error}; the request could not continue on another decode worker: {reason}",
        )
