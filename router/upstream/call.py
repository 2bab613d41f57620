"""One choice's generation on the workers: placement, the decode worker's NDJSON stream, one retry.

Failures before the first token are retried on other pods (a 400 is raised as is); after it they end the call
with ``finish_reason="error"``, ``retryable`` when only the worker was lost (router/upstream/migration.py then
continues the choice). Every wait has a deadline, which the pool's ``kill`` fires at once when a worker this call
depends on is declared down. Closing the call closes the stream, which the decode worker takes as an abort.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio

from common.protocol import DecodeError, GenerateRequest, SamplingParams, TokenLine, decode, encode
from router.decision.dispatch import Dispatcher, PromptPlan
from router.decision.policy import RouteDecision
from router.decision.pool import Worker
from router.errors import OpenAIError, bad_request, no_worker, rate_limited, upstream_failed
from router.upstream.status import Retry, WorkerAnswer, error_message, failure_for, retry_after_seconds
from router.wire import ConnectError, Response, WireError

log = logging.getLogger("kvferry.router")

__all__ = ["UpstreamCall"]

STALL_GRACE_S = 5.0  # after its worker is declared down, a live stream must show a token this often
# Tries before the first token: a decode-side failure uses one of DECODE_TRIES; one its prefill worker caused
# moves the prompt to another prefill worker (or the decode worker) without using one. MAX_ATTEMPTS bounds all.
DECODE_TRIES = 2
MAX_ATTEMPTS = 4
# A prompt given back by its decode worker is refused for room only once the worker's snapshots have had this many
# poll intervals to stop counting it (router/upstream/call.py `_route_given_back`).
GIVEN_BACK_SETTLE_POLLS = 20


def lost_event(reason: str) -> TokenLine:
    """The event a call ends with when only its worker was lost."""
    return TokenLine(finish_reason="error", error=reason, retryable=True)


class UpstreamCall:
    def __init__(self, dispatcher: Dispatcher, req_id: str, plan: PromptPlan, sampling: SamplingParams) -> None:
        self.d = dispatcher
        self.req_id = req_id
        self.plan = plan
        self.sampling = sampling
        self.decision: RouteDecision | None = None
        self.attempts = 0
        self._decode: Worker | None = None
        self._prefill: Worker | None = None
        self._resp: Response | None = None
        self._streaming_resp: Response | None = None  # the generate response once its status was 200
        self._deadline: asyncio.Timeout | None = None
        self._killed: str | None = None
        self._given_back = False  # `prefill_back` ended the first-token wait of a local placement
        self._closed = False
        self._worker_finished = False  # the worker sent its last event: the stream can end cleanly
        self._last_event = 0.0  # monotonic time of the last event read
        self._streaming = False  # the first event is in: failures can no longer be retried

    async def start(self, avoid_decode: str | None = None) -> TokenLine:
        """Routes and returns the first event; raises OpenAIError. ``avoid_decode``: a migrated request's old worker."""
        exclude_d: set[str] = {avoid_decode} if avoid_decode else set()
        exclude_p: set[str] = set()
        last: OpenAIError | None = None
        spent = 0  # tries that failed on a decode worker (or on no particular worker)
        moved_at: float | None = None  # when a local placement was given back (`prefill_back`)
        for attempt in range(MAX_ATTEMPTS):
            if spent >= DECODE_TRIES:
                break
            try:
                if moved_at is None:
                    decision = self.d.route(self.plan, self.sampling.max_tokens, exclude_d, exclude_p)
                else:
                    decision = await self._route_given_back(moved_at, exclude_d, exclude_p)
                    moved_at = None
            except OpenAIError as exc:
                # No worker left: the first attempt's error says more than "none ready", but "no room" stays 429.
                if last is not None and exc.status != 429:
                    raise last from None
                raise
            self.decision = decision
            self.attempts = attempt + 1
            if attempt:
                self.d.metrics.retries.inc()
            try:
                return await self._attempt(decision, attempt)
            except Retry as r:
                await self._release()
                if r.moved:  # placed again now that a prefill worker is up: no failure, no try used up
                    exclude_p.clear()
                    moved_at = time.monotonic()
                    log.info("local prefill given back to a prefill worker", extra={"req_id": self.req_id})
                    continue
                last = r.error
                if r.blame_decode or not r.blame_prefill:
                    spent += 1
                if r.blame_decode:
                    exclude_d.add(decision.decode)
                if r.blame_prefill and decision.prefill is not None:
                    exclude_p.add(decision.prefill)
                if r.local:
                    exclude_p.update(w.url for w in self.d.pool.prefillers())
                log.warning(
                    "upstream attempt failed before the first token",
                    extra={
                        "req_id": self.req_id,
                        "attempt": attempt,
                        "decode": decision.decode,
                        "prefill": decision.prefill,
                        "error": r.error.message,
                    },
                )
            except BaseException:
                await self._release()
                raise
        assert last is not None
        raise last

    async def _route_given_back(self, moved_at: float, exclude_d: set[str], exclude_p: set[str]) -> RouteDecision:
        """Places again a prompt its decode worker gave back. That worker drops the prompt at its engine's next
        step, and its /load counts the prompt's pages and queued tokens until then: the first placement waits for
        a snapshot asked after the move, and a refusal for room (429) is tried again on each newer snapshot for up
        to GIVEN_BACK_SETTLE_POLLS poll intervals, where a busy engine's step may still hold the prompt."""
        pool = self.d.pool
        settle_until = moved_at + GIVEN_BACK_SETTLE_POLLS * pool.poll_interval_s
        while True:
            asked_after = time.monotonic()
            await pool.fresh_loads(asked_after, timeout_s=3 * pool.poll_interval_s)
            try:
                return self.d.route(self.plan, self.sampling.max_tokens, exclude_d, exclude_p)
            except OpenAIError as exc:
                if exc.status != 429 or time.monotonic() >= settle_until:
                    raise

    async def _attempt(self, decision: RouteDecision, attempt: int) -> TokenLine:
        pool = self.d.pool
        dw = pool.workers.get(decision.decode)
        pw = pool.workers.get(decision.prefill) if decision.prefill else None
        if dw is None:
            raise Retry(no_worker("decode"), True, False)
        if self._closed:  # closed while it was being started (its owner is gone): hold nothing anywhere
            raise upstream_failed("the request was closed before it was sent")
        self._killed = None
        self._given_back = False
        self._decode, self._prefill = dw, pw
        now = time.monotonic()
        dw.hold_decode(self, now, len(self.plan.token_ids) + self.sampling.max_tokens)
        if pw is not None:
            pw.hold_prefill(self, now, len(self.plan.token_ids) - decision.prefill_matched_tokens)
        # Remember the placement before the worker publishes it (router/decision/locality.py says why).
        self.d.locator.placed((pw or dw).pod, self.plan.block_hashes)
        body = encode(
            GenerateRequest(
                req_id=self.req_id if attempt == 0 else f"{self.req_id}-retry{attempt}",
                token_ids=self.plan.token_ids,
                sampling=self.sampling,
                prefill_url=pw.url if pw is not None else None,
            )
        )
        blame_p = pw is not None
        record = self.plan.record
        headers = None
        if record is not None:
            record.dispatched(decision.reason)
            tp = record.traceparent()
            headers = {"traceparent": tp} if tp else None
        try:
            async with asyncio.timeout(self.d.first_token_timeout_s) as deadline:
                self._deadline = deadline
                if self._killed:
                    deadline.reschedule(asyncio.get_running_loop().time())
                url = f"{dw.url}/internal/generate"
                self._resp = resp = await self.d.client.request("POST", url, body, headers=headers)
                if self._closed:  # abandoned while the request was under way: the response has no reader
                    self.abandon()
                    raise upstream_failed("the request was closed")
                if resp.status != 200:
                    await self._status_error(resp, dw)
                self._streaming_resp = resp
                first = await self._first_event()
        except TimeoutError:
            if self._given_back:
                raise Retry(upstream_failed("given back to a prefill worker"), False, False, moved=True) from None
            if self._killed:  # the pool declared a worker down: avoid that one
                blame_d, blame_pf = not dw.up, pw is not None and not pw.up
                raise Retry(upstream_failed(self._killed), blame_d, blame_pf) from None
            reason = f"no first token within {self.d.first_token_timeout_s:g}s"
            raise Retry(upstream_failed(reason), True, blame_p) from None
        except ConnectError as exc:
            pool.report_failure(dw, f"connect: {exc}", hard=not exc.timed_out)
            raise Retry(upstream_failed(f"decode worker unreachable: {exc}"), True, False) from None
        except (WireError, DecodeError) as exc:  # reset mid-response, a line that is no TokenLine
            raise Retry(upstream_failed(f"decode worker failed: {type(exc).__name__}: {exc}"), True, blame_p) from None
        finally:
            self._deadline = None
        if first is None:
            raise Retry(upstream_failed("decode worker closed the stream before the first token"), True, blame_p)
        if first.finish_reason == "error" and not first.token_ids:
            # Failure before any token: with a prefill pod in play it is the likely culprit, so the retry avoids it.
            msg = first.error or "worker error"
            if first.invalid_request:  # the request's own fault: the same on any worker
                raise bad_request(msg)
            if first.overloaded:  # its prefill worker is alive but too busy: a 429 if nothing else takes it
                busy = rate_limited(f"the prefill workers are busy: {msg}", self.d.retry_after_s)
                raise Retry(busy, False, True)
            raise Retry(upstream_failed(f"generation failed before the first token: {msg}"), not blame_p, blame_p)
        self._prefill_started()
        self._streaming = True
        if record is not None:
            record.upstream(first.timeline)
        return first

    async def _status_error(self, resp: Response, dw: Worker) -> None:
        try:
            raw = await resp.read()
        finally:
            await resp.aclose()
        message, code = error_message(resp.status, raw)
        retry_after = self.d.retry_after_s
        if resp.status == 429:
            retry_after = retry_after_seconds(resp.headers.get("retry-after"), retry_after)
        if resp.status == 503:
            dw.refused_not_ready()
        raise failure_for(WorkerAnswer(resp.status, code, message, retry_after, self._prefill is not None))

    def next_nowait(self) -> TokenLine | None:
        """The next event if already arrived, else None: a caller that fell behind drains these before writing."""
        resp = self._streaming_resp
        if resp is None or self._closed:
            return None
        try:
            while (line := resp.line_nowait()) is not None:
                if line.strip():
                    return self._event(line)
        except DecodeError as exc:
            return lost_event(f"decode worker sent a malformed line: {exc}")
        return None

    async def next(self) -> TokenLine | None:
        """The next event, None at the end of the stream; failures come back as an "error" finish."""
        if self._streaming_resp is None or self._closed:
            return None
        ev = self.next_nowait()  # already here: no deadline to arm
        if ev is not None:
            return ev
        # A stream whose worker was declared down keeps going only while tokens keep coming (kill()).
        limit = min(self.d.inter_token_timeout_s, STALL_GRACE_S) if self._killed else self.d.inter_token_timeout_s
        try:
            async with asyncio.timeout(limit) as deadline:
                self._deadline = deadline
                ev = await self._read_event()
        except TimeoutError:
            reason = f"{self._killed}; no token for {limit:g}s" if self._killed else f"no token for {limit:g}s"
            return lost_event(reason)
        except WireError as exc:
            return lost_event(f"decode worker failed: {type(exc).__name__}: {exc}")
        except DecodeError as exc:
            return lost_event(f"decode worker sent a malformed line: {exc}")
        finally:
            self._deadline = None
        if ev is None:
            return lost_event("decode worker closed the stream without finishing")
        return ev

    async def _first_event(self) -> TokenLine | None:
        """The first event, with the prompt's logprobs a long prompt's lines carried ahead of it joined into it."""
        first = await self._read_event()
        while (
            first is not None and first.prompt_logprobs is not None and not first.token_ids and not first.finish_reason
        ):
            head = first.prompt_logprobs
            first = await self._read_event()
            if first is not None:
                if first.prompt_logprobs is not None:
                    head.extend(first.prompt_logprobs)
                first.prompt_logprobs = head
        return first

    async def _read_event(self) -> TokenLine | None:
        resp = self._streaming_resp
        assert resp is not None
        while (line := await resp.next_line()) is not None:
            if line.strip():
                return self._event(line)
        return None

    def _event(self, line: bytes) -> TokenLine:
        ev = decode(line, TokenLine)
        if ev.finish_reason is not None:
            self._worker_finished = True
        # A worker streaming to us is alive, however late its load polls (router/decision/pool.py).
        self._last_event = time.monotonic()
        if self._decode is not None:
            self._decode.streamed(self._last_event)
        return ev

    def kill(self, reason: str) -> None:
        """The pool declared a worker this call waits on down. Before the first token the wait ends at once; a
        live stream only gets a grace deadline per token (a busy worker may miss polls yet stream fine)."""
        if self._killed is None:
            self._killed = reason
        if self._deadline is not None:
            now = asyncio.get_running_loop().time()
            when = now
            if self._streaming:
                grace = max(0.0, self._last_event + STALL_GRACE_S - time.monotonic())
                current = self._deadline.when()
                when = now + grace if current is None else min(current, now + grace)
            try:
                self._deadline.reschedule(when)
            except RuntimeError:
                # The wait is already over: this call itself is declaring the worker down (a refused connection).
                pass

    def prefill_back(self) -> None:
        """A prefill worker came (back) up: a prompt placed on its decode worker for lack of one, still before its
        first token, is placed again (a decode worker's local prefill runs in small chunks beside its streams)."""
        decision = self.decision
        if (
            self._streaming
            or self._given_back
            or self._deadline is None
            or decision is None
            or decision.prefill is not None
            or decision.reason != "no-prefill"
            or len(self.plan.token_ids) < self.d.policy.cfg.disagg_min_prompt_tokens
        ):
            return
        self._given_back = True
        self._deadline.reschedule(asyncio.get_running_loop().time())

    def _prefill_started(self) -> None:
        """First token seen: the prefill pod's part is over."""
        pw, self._prefill = self._prefill, None
        if pw is not None:
            pw.release_prefill(self)

    def _let_go(self) -> Response | None:
        """Drops everything this call holds in the pool, with no await; returns the response still to close."""
        self._prefill_started()
        dw, self._decode = self._decode, None
        if dw is not None:
            dw.release_decode(self)
        self._streaming_resp = None
        resp, self._resp = self._resp, None
        return resp

    async def _release(self) -> None:
        finished = self._worker_finished
        resp = self._let_go()
        if resp is None:
            return
        try:
            if finished and not resp.ended:
                # Reading the terminating chunk returns the connection to the pool (a new one costs more).
                with anyio.move_on_after(1.0):
                    try:
                        await resp.read()
                    except WireError:
                        pass
        finally:
            # Closing an unfinished stream is the workers' abort signal; it never waits.
            resp.close()

    def abandon(self) -> None:
        """Ends the call without waiting: nothing held, the stream closed (an abort). Idempotent."""
        self._closed = True
        resp = self._let_go()
        if resp is not None:
            resp.close()

    async def aclose(self) -> None:
        if self._closed:
            self.abandon()  # a no-op unless a concurrent start() got further meanwhile
            return
        self._closed = True
        await self._release()
