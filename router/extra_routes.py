"""Routes beyond chat and completions: OpenAI's /v1/responses (a subset) and vLLM's /tokenize, /detokenize.

/v1/responses is the chat pipeline with another envelope: its input (a string, or messages and function
call items) becomes a chat request, so templates, tools, structured outputs and routing are the same; the
output is a "response" object, streamed as typed events (response.created ... response.completed). The
subset: text in and out, function tools, text.format (json_object / json_schema), streaming; nothing
stored (previous_response_id and background are refused).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError, field_validator

from common.managed_stream import ManagedStream
from router.errors import bad_request, model_not_found, no_worker, upstream_failed
from router.runtime import RuntimeSlot
from router.surface.disconnect import ClientGone, unless_disconnected
from router.surface.job import Job, RunningChoice
from router.surface.openai_api import ChatCompletionRequest, _Lenient, _RefusesUnsupported
from router.surface.responses import SSE_HEADERS
from router.surface.service import RouterService
from router.surface.tools import ToolCall, finish_reason_with_calls, parse_tool_calls

__all__ = ["install_extra_routes"]


# ---- /v1/responses -------------------------------------------------------------------------------------
class _FunctionTool(_Lenient):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class _TextOptions(_Lenient):
    format: _TextFormat | None = None


class ResponsesRequest(_RefusesUnsupported):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    stream: bool = False
    tools: list[_FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: _TextOptions | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None

    @field_validator("previous_response_id")
    @classmethod
    def _no_state(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("responses are not stored: send the whole conversation as input")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("background responses are not supported")
        return v

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and any(x is not None for x in v.values()):
            raise ValueError("reasoning options are not supported: this model does not reason")
        return v

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (ValueError / ValidationError for bad input)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                _append_item(messages, item)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            body["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif choice is not None:
            body["tool_choice"] = choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict},
            }
        return ChatCompletionRequest.model_validate(body)


def _text_of(content: Any) -> str | list[dict[str, Any]]:
    if isinstance(content, list):
        return [
            {**p, "type": "text"} if isinstance(p, dict) and p.get("type") in ("input_text", "output_text") else p
            for p in content
        ]
    return content


def _append_item(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        messages.append({"role": item.get("role"), "content": _text_of(item.get("content"))})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output", "")})
    else:
        raise ValueError(f"input item type {kind!r} is not supported (message, function_call, function_call_output)")


def _usage(job: Job, choices: list[RunningChoice]) -> dict[str, Any]:
    prompt = sum(len(p) for p in job.prompts)
    out = sum(c.state.completion_tokens for c in choices)
    cached = sum(c.state.cached_tokens for c in choices)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + out,
    }


class _ResponseShape:
    """The response object of one /v1/responses call, in its stages."""

    def __init__(self, body: ResponsesRequest, chat: ChatCompletionRequest, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body = body
        self.chat = chat
        self.model = model

    def envelope(
        self, status: str, output: list[dict[str, Any]], use: dict[str, Any] | None, reason: str | None
    ) -> dict[str, Any]:
        fmt = self.body.text.format if self.body.text and self.body.text.format else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.body.parallel_tool_calls is not False,
            "temperature": self.body.temperature,
            "top_p": self.body.top_p,
            "tool_choice": self.body.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in self.body.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "usage": use,
            "metadata": {},
        }

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def function_call(call: ToolCall) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{call.id.removeprefix('call_')}",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }

    def output(self, text: str, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        chat = self.chat
        if chat.tool_mode == "none":
            return [self.message(text)], reason
        content, calls = parse_tool_calls(text, chat.tool_mode, chat.tools or [], chat.named_tool)
        items = [self.message(content)] if content else []
        items += [self.function_call(c) for c in calls]
        return items, finish_reason_with_calls(reason, calls)


def _event(seq: int, kind: str, **fields: Any) -> bytes:
    return (
        b"event: "
        + kind.encode()
        + b"\ndata: "
        + orjson.dumps({"type": kind, "sequence_number": seq, **fields})
        + b"\n\n"
    )


def install_extra_routes(app: FastAPI, slot: RuntimeSlot) -> None:
    """Adds /v1/responses, /tokenize and /detokenize to the router's app (`slot`: its runtime)."""

    @app.post("/v1/responses")
    async def responses(request: Request, body: ResponsesRequest) -> Response:
        service = slot.service
        if not service.model.serves(body.model):
            raise model_not_found(body.model or "")
        try:
            chat = body.chat_request()
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err.get("loc", ()))
            msg = str(err.get("msg", "invalid input")).removeprefix("Value error, ")
            raise bad_request(f"input: {loc + ': ' if loc else ''}{msg}", "input") from None
        except ValueError as e:
            raise bad_request(str(e), "input") from None
        ticket = service.admit()
        handed_off = False
        job: Job | None = None
        try:
            job = await service.prompts.prepare_chat(chat)
            if not slot.pool.decoders():
                raise no_worker("decode")
            shape = _ResponseShape(body, chat, job.model)
            choices = await unless_disconnected(request, service.start(job))
            if body.stream:
                stream = _stream_events(service, job, choices, shape)

                async def on_close() -> None:
                    try:
                        await stream.aclose()
                    finally:
                        await service.end(ticket, choices)

                handed_off = True
                return ManagedStream(stream, on_close, "text/event-stream", SSE_HEADERS)
            result = await unless_disconnected(request, service.collect(job, choices))
            text = "".join(t for c in choices for t in c.text)
            output, reason = shape.output(text, choices[0].state.finish_reason)
            status = "incomplete" if result["choices"][0]["finish_reason"] == "length" else "completed"
            return JSONResponse(shape.envelope(status, output, _usage(job, choices), reason))
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_off:
                await service.end(ticket, job.choices if job is not None else [])

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        service = slot.service
        if not service.model.serves(body.model):
            raise model_not_found(body.model or "")
        # Tokenized as a prompt is (router/surface/service.py): up to the model's context, longer texts are refused.
        if body.messages is not None:
            try:
                chat = ChatCompletionRequest.model_validate(
                    {
                        "messages": body.messages,
                        "tools": body.tools,
                        "add_generation_prompt": body.add_generation_prompt,
                        "continue_final_message": body.continue_final_message,
                    }
                )
            except ValidationError as e:
                raise bad_request(
                    str(e.errors()[0].get("msg", "invalid messages")).removeprefix("Value error, "), "messages"
                ) from None
            ids = await service.prompts.encode_chat(
                chat.chat_messages(), chat.tools, chat.add_generation_prompt, chat.continue_final_message
            )
        elif body.prompt is not None:
            ids = await service.prompts.encode_text(body.prompt, "prompt", body.add_special_tokens)
        else:
            raise bad_request("send prompt or messages", "prompt")
        return {"count": len(ids), "max_model_len": service.model.max_context, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        service = slot.service
        if not service.model.serves(body.model):
            raise model_not_found(body.model or "")
        if any(t < 0 or t >= service.tok.vocab_size for t in body.tokens):
            raise bad_request(f"token ids must be in [0, {service.tok.vocab_size})", "tokens")
        return {"prompt": service.tok.decode(body.tokens)}


async def _stream_events(
    service: RouterService, job: Job, choices: list[RunningChoice], shape: _ResponseShape
) -> AsyncIterator[bytes]:
    seq = 0

    def ev(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return _event(seq - 1, kind, **fields)

    yield ev("response.created", response=shape.envelope("in_progress", [], None, None))
    yield ev("response.in_progress", response=shape.envelope("in_progress", [], None, None))
    tools = shape.chat.tool_mode != "none"
    ids = {"item_id": shape.msg_id, "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": "", "annotations": []}
    if not tools:  # with tools the output's items are known at the end
        yield ev("response.output_item.added", output_index=0, item=shape.message("", "in_progress"))
        yield ev("response.content_part.added", part=part, **ids)
    pieces: list[str] = []
    reason: str | None = None
    async for batch in service.deltas(choices):
        out = []
        for d in batch:
            if d.error is not None:
                err = upstream_failed(f"generation failed: {d.error}")
                yield ev("error", code=err.code, message=err.message, param=None)
                return
            if d.text:
                pieces.append(d.text)
                if not tools:
                    out.append(ev("response.output_text.delta", delta=d.text, logprobs=[], **ids))
            if d.finish_reason is not None:
                reason = d.finish_reason
        if out:
            yield b"".join(out)
    text = "".join(pieces)
    output, final_reason = shape.output(text, reason)
    if not tools:
        yield ev("response.output_text.done", text=text, logprobs=[], **ids)
        yield ev("response.content_part.done", part={**part, "text": text}, **ids)
        yield ev("response.output_item.done", output_index=0, item=output[0])
    else:
        for i, item in enumerate(output):
            yield ev("response.output_item.added", output_index=i, item=item)
            yield ev("response.output_item.done", output_index=i, item=item)
    status = "incomplete" if reason == "length" else "completed"
    done = "response.incomplete" if status == "incomplete" else "response.completed"
    yield ev(done, response=shape.envelope(status, output, _usage(job, choices), final_reason))


# ---- /tokenize, /detokenize (vLLM's shapes) ------------------------------------------------------------
class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)
