"""A request body to a `Job`: the prompt tokenized (up to the model's context at most, one past it: 400; long
texts off the event loop) and the client's sampling checked against the model, before anything is routed."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from common.protocol import TokenIds
from router.errors import bad_request, context_too_long, prompt_too_long
from router.settings import RouterOptions
from router.surface.job import Job
from router.surface.openai_api import ChatCompletionRequest, CompletionRequest
from router.surface.tokenizer import ModelInfo, PromptTooLong, RouterTokenizer
from router.surface.tools import Tool

__all__ = ["PromptPreparer"]

_LONG_TEXT = 8192  # characters: tokenize off the event loop above this
# Bounded: a burst of long prompts queues here instead of taking the event loop's cores (and malloc arenas).
_TOKENIZE_THREADS = 2


class PromptPreparer:
    def __init__(self, tokenizer: RouterTokenizer, model: ModelInfo, opts: RouterOptions) -> None:
        self.tok = tokenizer
        self.model = model
        self.opts = opts
        self._tokenizing = ThreadPoolExecutor(_TOKENIZE_THREADS, thread_name_prefix="tokenize")

    async def _tokenize(self, chars: int, param: str, encode: Callable[[], list[int]]) -> TokenIds:
        try:
            if chars > _LONG_TEXT:
                return tuple(await asyncio.get_running_loop().run_in_executor(self._tokenizing, encode))
            return tuple(encode())
        except PromptTooLong as exc:
            raise prompt_too_long(self.model.max_context, exc.at_least, param) from None

    async def encode_text(self, text: str, param: str, add_special_tokens: bool = True) -> TokenIds:
        """A text's token ids (400 for text that is not Unicode or longer than the context)."""
        limit = self.model.max_context
        try:
            return await self._tokenize(len(text), param, lambda: self.tok.encode(text, add_special_tokens, limit))
        except ValueError as exc:  # the tokenizer refuses text that is not valid Unicode
            raise bad_request(str(exc), param) from None

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[Tool] | None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> TokenIds:
        """A conversation's prompt ids through the chat template (400 as in ``encode_text``, or if refused)."""
        chars = _text_chars(messages)
        limit = self.model.max_context

        def encode() -> list[int]:
            return self.tok.encode_chat(messages, tools, limit, add_generation_prompt, continue_final_message)

        try:
            return await self._tokenize(chars, "messages", encode)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None

    async def prepare_chat(self, req: ChatCompletionRequest) -> Job:
        ids = await self.encode_chat(
            req.chat_messages(), req.tools, req.add_generation_prompt, req.continue_final_message
        )
        if not ids:
            raise bad_request("messages produce an empty prompt", "messages")
        max_tokens = self._max_tokens(len(ids), req.requested_max_tokens(), "messages", chat=True)
        self._check_sampling(req, [max_tokens])
        job = self._job("chat", req, [ids], [max_tokens], req.logprobs, req.top_logprobs or 0)
        job.prompt_logprobs = job.worker_prompt_logprobs = req.wanted_prompt_logprobs()
        echo = req.echo_text()
        job.echo = [echo] if echo else []
        return job

    async def prepare_completion(self, req: CompletionRequest) -> Job:
        prompts: list[TokenIds] = []
        echo: list[str] = []
        for p in req.prompts():
            if isinstance(p, str):
                ids = await self.encode_text(p, "prompt")
                if not ids:
                    raise bad_request("prompt must not be empty", "prompt")
            else:
                ids = tuple(p)  # validated ints already; the body's own tuple, not a copy
                if any(t < 0 or t >= self.tok.vocab_size for t in ids):
                    raise bad_request(f"prompt token ids must be in [0, {self.tok.vocab_size})", "prompt")
            prompts.append(ids)
            if req.echo:
                echo.append(p if isinstance(p, str) else self.tok.decode(ids))
        # Echo alone (max_tokens 0) still samples one token, which the response drops: as vLLM does.
        requested = 1 if req.echo_only else req.max_tokens
        max_tokens = [self._max_tokens(len(ids), requested, "prompt", chat=False) for ids in prompts]
        self._check_sampling(req, max_tokens)
        job = self._job("completion", req, prompts, max_tokens, req.logprobs is not None, req.logprobs or 0)
        job.echo = echo
        job.echo_logprobs, job.echo_only = req.echo_logprobs, req.echo_only
        job.prompt_logprobs = req.wanted_prompt_logprobs()
        job.worker_prompt_logprobs = req.worker_prompt_logprobs()
        return job

    def _job(
        self,
        kind: Literal["chat", "completion"],
        req: ChatCompletionRequest | CompletionRequest,
        prompts: list[TokenIds],
        max_tokens: list[int],
        logprobs: bool,
        top_logprobs: int,
    ) -> Job:
        return Job(
            kind=kind,
            rid=f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model.name,
            request=req,
            prompts=prompts,
            max_tokens=max_tokens,
            n=req.n,
            stops=req.stop_list,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
        )

    def _check_sampling(self, req: ChatCompletionRequest | CompletionRequest, max_tokens: list[int]) -> None:
        bad = [t for t in req.logit_bias_ids() if t >= self.tok.vocab_size]
        if bad:
            raise bad_request(f"logit_bias token ids must be in [0, {self.tok.vocab_size}); got {bad[0]}", "logit_bias")
        if any(t < 0 or t >= self.tok.vocab_size for t in req.stop_token_ids or []):
            raise bad_request(f"stop_token_ids must be in [0, {self.tok.vocab_size})", "stop_token_ids")
        if req.min_tokens and req.min_tokens > min(max_tokens):
            raise bad_request(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({min(max_tokens)})", "min_tokens")

    def _max_tokens(self, prompt_len: int, requested: int | None, param: str, chat: bool) -> int:
        ctx = self.model.max_context
        if requested is None:
            # OpenAI's defaults: 16 for legacy completions; chat runs to a configurable cap (workers reserve KV
            # for the whole output up front).
            room = ctx - prompt_len
            if room < 1:
                raise context_too_long(ctx, prompt_len, 1, param)
            return min(room, self.opts.default_max_tokens) if chat else min(room, 16)
        if prompt_len + requested > ctx:
            raise context_too_long(ctx, prompt_len, requested, param)
        return requested


def _text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0
