"""The request pipeline behind both OpenAI endpoints: prompt -> token ids -> checks -> n upstream calls -> one
JSON body or one SSE stream. The client's faults are checked, and every choice's first token awaited, before
the response starts, so failures still get a real status code instead of an error inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio

from common.loop_lag import LoopLag
from common.protocol import PromptLogprobs
from common.slo import DEFAULT_SLO_SPEC, SloClasses, parse_slo_classes
from router.decision.dispatch import Dispatcher
from router.errors import bad_request, rate_limited, upstream_failed
from router.settings import RouterOptions
from router.surface.choice import ChoiceDelta, ChoiceState, TokenInfo
from router.surface.job import Admission, Job, RunningChoice
from router.surface.openai_api import ChatCompletionRequest
from router.surface.prepare import PromptPreparer
from router.surface.responses import (
    SSE_DONE,
    ChunkFormat,
    chat_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    echo_logprobs,
    joined_logprobs,
    prompt_logprobs,
    response,
    sse,
    usage,
)
from router.surface.tokenizer import ModelInfo, RouterTokenizer
from router.surface.tools import ToolCallStream, finish_reason_with_calls, parse_tool_calls
from router.upstream.migration import MigratingCall

SLO_CLASS_HEADER = "x-kvferry-class"  # names the request's SLO class (else `priority`, else the default)

__all__ = ["RouterService"]

log = logging.getLogger("kvferry.router")

_CONTEXT_IDS = 4  # prompt ids fed to the detokenizer ahead of the output (SentencePiece leading spaces)


class RouterService:
    def __init__(
        self,
        tokenizer: RouterTokenizer,
        model: ModelInfo,
        dispatcher: Dispatcher,
        opts: RouterOptions,
        slo: SloClasses | None = None,
        relay_lag: LoopLag | None = None,
    ) -> None:
        self.slo = slo if slo is not None else parse_slo_classes(DEFAULT_SLO_SPEC)
        self.relay_lag = relay_lag  # None: workers aim at the class's ITL target itself
        self.tok = tokenizer
        self.model = model
        self.dispatcher = dispatcher
        self.opts = opts
        self._admitted: set[Admission] = set()
        self.prompts = PromptPreparer(tokenizer, model, opts)

    # ---- admission ---------------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        """Counted from the live admissions, never a sum of +1/-1."""
        return len(self._admitted)

    def admit(self) -> Admission:
        if self.inflight >= self.opts.max_inflight:
            raise rate_limited(
                f"The router is at its limit of {self.opts.max_inflight} concurrent requests; retry shortly.",
                self.opts.retry_after_s,
            )
        ticket = Admission()
        self._admitted.add(ticket)
        return ticket

    def release(self, ticket: Admission) -> None:
        self._admitted.discard(ticket)

    def slo_class(self, priority: int | None, header: str | None) -> str:
        """The x-kvferry-class header's class (400 if undeclared), else vLLM's `priority` shifted from the default."""
        if header:
            try:
                return self.slo.get(header.strip()).name
            except ValueError as exc:
                raise bad_request(str(exc), SLO_CLASS_HEADER) from None
        return self.slo.by_priority(priority or 0).name

    # ---- starting ----------------------------------------------------------------------------------
    async def start(self, job: Job) -> list[RunningChoice]:
        """Routes every choice and waits for each first event; on any failure closes them all and raises."""
        request_tokens = job.n * sum(len(ids) + m for ids, m in zip(job.prompts, job.max_tokens, strict=True))
        self.dispatcher.check_request_kv(request_tokens, _kv_detail(job))
        calls = job.n * len(job.prompts)
        self.dispatcher.check_request_calls(calls, f"n={job.n} x {len(job.prompts)} prompts")
        plans = [await self.dispatcher.plan(ids) for ids in job.prompts]
        cls = self.slo.get(job.slo_class)
        for plan in plans:
            plan.record = job.record
            plan.request_tokens = request_tokens
            plan.slo_class = cls
        # Admission by predicted TTFT, once per request: its prompts queue together, so the longest decides.
        self.dispatcher.check_ttft(max(plans, key=lambda p: len(p.token_ids)), cls)
        choices = job.choices
        context_ok = self.tok.needs_context
        for p_idx, plan in enumerate(plans):
            for i in range(job.n):
                idx = p_idx * job.n + i
                # A prompt's logprobs are computed once, by its first choice (the others may hit the prefix cache).
                scored = job.worker_prompt_logprobs if i == 0 else None
                sampling = job.request.sampling(
                    job.max_tokens[p_idx], i, job.logprobs, job.top_logprobs, job.slo_class, scored
                )
                if self.relay_lag is not None:
                    sampling = self.relay_lag.add_to(sampling)
                call = MigratingCall(
                    self.dispatcher,
                    f"{job.rid}-{idx}",
                    plan,
                    sampling,
                    self.opts.migration_limit,
                    self.opts.migration_wait_s,
                )
                ctx = plan.token_ids[-_CONTEXT_IDS:] if context_ok else ()
                state = ChoiceState(idx, self.tok, job.stops, ctx, job.logprobs)
                choices.append(RunningChoice(idx, p_idx, call, state, tools=_tool_stream(job)))
        try:
            if len(choices) == 1:
                choices[0].first = await choices[0].call.start()
            else:
                firsts = await asyncio.gather(*(c.call.start() for c in choices), return_exceptions=True)
                for c, first in zip(choices, firsts, strict=True):
                    if isinstance(first, BaseException):
                        raise first
                    c.first = first
        except BaseException:
            await self.close(choices)
            raise
        return choices

    async def end(self, ticket: Admission, choices: list[RunningChoice]) -> None:
        """Lets go of what a request holds, however it ended: its calls closed (shielded), its ticket released."""
        try:
            with anyio.CancelScope(shield=True):
                await self.close(choices)
        finally:
            self.release(ticket)

    async def close(self, choices: list[RunningChoice]) -> None:
        """Closes the choices' upstream calls; however interrupted, every call ends up abandoned."""
        try:
            for c in choices:
                await c.call.aclose()
        finally:
            for c in choices:
                c.call.abandon()

    async def _drive(self, c: RunningChoice) -> AsyncIterator[list[ChoiceDelta]]:
        """Feeds one choice's events through its state until it finishes, in batches (one awaited event plus all
        already behind it); closes the upstream stream at once when the choice finishes."""
        ev = c.first
        gaps = c.gaps
        try:
            while ev is not None:
                batch = []
                tokens = 0
                while ev is not None:
                    tokens += len(ev.token_ids)
                    batch.append(c.state.feed(ev))
                    if c.state.finished:
                        break
                    ev = c.call.next_nowait()
                if gaps is not None:
                    gaps.add(tokens)
                yield batch
                if c.state.finished:
                    break
                ev = await c.call.next()
        finally:
            await c.call.aclose()

    # ---- non-streaming -------------------------------------------------------------------------------
    async def collect(self, job: Job, choices: list[RunningChoice]) -> dict[str, Any]:
        async def run(c: RunningChoice) -> None:
            async for batch in self._drive(c):
                for delta in batch:
                    c.text.append(delta.text)
                    c.tokens.extend(delta.tokens)

        if len(choices) == 1:
            await run(choices[0])
        else:
            await asyncio.gather(*(run(c) for c in choices))
        failed = [c for c in choices if c.state.finish_reason == "error"]
        if failed:
            if failed[0].state.invalid_request:
                raise bad_request(f"generation failed: {failed[0].state.error}")
            raise upstream_failed(f"generation failed: {failed[0].state.error}")
        out = []
        for c in choices:
            text = "" if job.echo_only else "".join(c.text)
            echo = job.echo[c.prompt_index] if job.echo else ""  # its prompt's text, or the final assistant message's
            if job.kind == "chat":
                lp = chat_logprobs(c.tokens, self.tok) if job.logprobs else None
                if c.tools is not None:
                    req = c.tools
                    content, calls = parse_tool_calls(text, req.mode, req.tools, req.choice)
                    reason = finish_reason_with_calls(c.state.finish_reason, calls)
                    content = echo + (content or "") if echo else content
                    out.append(chat_choice(c.index, content, reason, lp, [x.as_dict() for x in calls]))
                    continue
                out.append(chat_choice(c.index, echo + text, c.state.finish_reason, lp))
            else:
                lp = self._completion_logprobs(job, c, c.tokens) if job.logprobs else None
                choice = completion_choice(c.index, echo + text, c.state.finish_reason, lp)
                if job.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(job, c)
                out.append(choice)
        use = self._usage(job, choices)
        body = response(job.kind, job.rid, job.created, job.model, out, use)
        if job.kind == "chat" and job.prompt_logprobs is not None:  # vLLM's: one prompt, on the response
            body["prompt_logprobs"] = self._prompt_logprobs(job, choices[0])
        return body

    @staticmethod
    def _scored(job: Job, c: RunningChoice) -> PromptLogprobs | None:
        """The choice's prompt's logprobs, which its prompt's first choice computed."""
        first = job.choices[c.prompt_index * job.n].first
        return first.prompt_logprobs if first is not None else None

    def _prompt_logprobs(self, job: Job, c: RunningChoice) -> list[dict[str, dict[str, Any]] | None] | None:
        scored = self._scored(job, c)
        return prompt_logprobs(job.prompts[c.prompt_index], scored, job.prompt_logprobs or 0, self.tok)

    def _completion_logprobs(
        self, job: Job, c: RunningChoice, tokens: list[TokenInfo], first: bool = True
    ) -> dict[str, Any]:
        """The legacy logprobs of ``tokens`` (continuing at ``c.offset``), behind the prompt's with echo in the
        choice's first piece; echo alone (max_tokens 0) drops the output's."""
        if job.echo_only:
            tokens = []
        if not (job.echo_logprobs and first):
            lp, c.offset = completion_logprobs(tokens, self.tok, c.offset)
            return lp
        scored = self._scored(job, c)
        head, c.offset = echo_logprobs(job.prompts[c.prompt_index], scored, job.top_logprobs, self.tok)
        lp, c.offset = completion_logprobs(tokens, self.tok, c.offset)
        return joined_logprobs(head, lp)

    def _usage(self, job: Job, choices: list[RunningChoice]) -> dict[str, Any]:
        # Prompt tokens count once per prompt, cached tokens per prompt's first choice (OpenAI bills n > 1 so).
        prompt = sum(len(p) for p in job.prompts)
        completion = 0 if job.echo_only else sum(c.state.completion_tokens for c in choices)
        cached = sum(c.state.cached_tokens for c in choices if c.index % job.n == 0)
        return usage(prompt, completion, cached)

    # ---- streaming -----------------------------------------------------------------------------------
    async def stream(self, job: Job, choices: list[RunningChoice]) -> AsyncIterator[bytes]:
        """SSE bytes, one piece per batch of worker events; whatever fails after the start, the client still
        gets an error event and [DONE]."""
        try:
            async for piece in self._stream(job, choices):
                yield piece
        except Exception as exc:
            log.exception("stream failed", extra={"rid": job.rid})
            error = upstream_failed(f"generation failed: {type(exc).__name__}: {exc}").body()["error"]
            yield sse({"error": error}) + SSE_DONE

    async def _stream(self, job: Job, choices: list[RunningChoice]) -> AsyncIterator[bytes]:
        chat = job.kind == "chat"
        fmt = ChunkFormat(
            "chat.completion.chunk" if chat else "text_completion", job.rid, job.created, job.model, job.include_usage
        )
        if chat:  # OpenAI opens each choice with the role
            opening = usage(len(job.prompts[0]), 0, 0) if job.continuous_usage else None
            yield fmt.chunk(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for c in choices
                ],
                opening,
            )
            if job.echo:  # the final assistant message's text, ahead of the reply
                yield fmt.chunk(
                    [
                        {"index": c.index, "delta": {"content": job.echo[0]}, "logprobs": None, "finish_reason": None}
                        for c in choices
                    ],
                    opening,
                )
        by_index = {c.index: c for c in choices}
        async for batch in self._merged(choices):
            out: list[bytes] = []
            for delta in batch:
                if delta.error is not None:
                    out += (
                        sse({"error": upstream_failed(f"generation failed: {delta.error}").body()["error"]}),
                        SSE_DONE,
                    )
                    yield b"".join(out)
                    return
                if not delta.empty:
                    out.append(self._render(job, fmt, by_index[delta.index], delta))
            if out:
                yield b"".join(out)
        tail = [fmt.usage_chunk(self._usage(job, choices))] if job.include_usage else []
        yield b"".join([*tail, SSE_DONE])

    def _render(self, job: Job, fmt: ChunkFormat, c: RunningChoice, delta: ChoiceDelta) -> bytes:
        # vLLM's continuous usage stats: the choice's own counts so far, on every chunk.
        use = self._choice_usage(job, c, delta) if job.continuous_usage else None
        if c.tools is not None:
            return self._render_tools(job, fmt, c, c.tools, delta, use)
        if job.kind == "chat":
            parts = b""
            if delta.text or delta.tokens:
                lp = chat_logprobs(delta.tokens, self.tok) if job.logprobs else None
                parts = fmt.chunk(
                    [{"index": c.index, "delta": {"content": delta.text}, "logprobs": lp, "finish_reason": None}], use
                )
            if delta.finish_reason is not None:
                parts += fmt.chunk(
                    [{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": delta.finish_reason}], use
                )
            return parts
        first = job.echo and not c.echoed
        lp = self._completion_logprobs(job, c, delta.tokens, first) if job.logprobs else None
        text = "" if job.echo_only else delta.text
        if first:  # the prompt's text (and its logprobs) open the choice's first chunk
            text, c.echoed = job.echo[c.prompt_index] + text, True
        return fmt.chunk([{"index": c.index, "text": text, "logprobs": lp, "finish_reason": delta.finish_reason}], use)

    @staticmethod
    def _choice_usage(job: Job, c: RunningChoice, delta: ChoiceDelta) -> dict[str, Any]:
        completion = 0 if job.echo_only else delta.completion_tokens
        return usage(len(job.prompts[c.prompt_index]), completion, c.state.cached_tokens)

    def _render_tools(
        self,
        job: Job,
        fmt: ChunkFormat,
        c: RunningChoice,
        tools: ToolCallStream,
        delta: ChoiceDelta,
        use: dict[str, Any] | None,
    ) -> bytes:
        """A chat choice with tools: content or tool-call deltas (router/surface/tools.py decides)."""
        deltas = tools.push(delta.text)
        if delta.finish_reason is not None:
            deltas += tools.finish()
        lp = chat_logprobs(delta.tokens, self.tok) if job.logprobs and delta.tokens else None
        if lp is not None and not deltas:
            deltas = [{}]
        parts = b""
        for i, d in enumerate(deltas):
            parts += fmt.chunk(
                [{"index": c.index, "delta": d, "logprobs": lp if i == 0 else None, "finish_reason": None}], use
            )
        if delta.finish_reason is not None:
            reason = finish_reason_with_calls(delta.finish_reason, tools.calls)
            parts += fmt.chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason}], use)
        return parts

    async def deltas(self, choices: list[RunningChoice]) -> AsyncIterator[list[ChoiceDelta]]:
        """The choices' text deltas as they come (for response shapes other than chat and completions)."""
        async for batch in self._merged(choices):
            yield batch

    async def _merged(self, choices: list[RunningChoice]) -> AsyncIterator[list[ChoiceDelta]]:
        """Batches of deltas of all choices in arrival order (n > 1 runs the choices concurrently)."""
        if len(choices) == 1:
            async for batch in self._drive(choices[0]):
                yield batch
            return
        # Unbounded: a pump must never block on put while cancelled; max_tokens bounds it anyway.
        queue: asyncio.Queue[list[ChoiceDelta] | None] = asyncio.Queue()

        async def pump(c: RunningChoice) -> None:
            try:
                async for batch in self._drive(c):
                    queue.put_nowait(batch)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _kv_detail(job: Job) -> str:
    terms = " + ".join(
        f"(prompt {len(ids)} + max_tokens {m})" for ids, m in zip(job.prompts, job.max_tokens, strict=True)
    )
    return f"n={job.n} x {terms}" if len(job.prompts) == 1 else f"n={job.n} x [{terms}]"


def _tool_stream(job: Job) -> ToolCallStream | None:
    req = job.request
    if not isinstance(req, ChatCompletionRequest) or req.tool_mode == "none":
        return None
    return ToolCallStream(req.tool_mode, req.tools or [], req.named_tool)
