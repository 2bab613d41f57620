"""One file because both OpenAI endpoints' bodies share one sampling model, its limits and its validators.

Request bodies of the OpenAI endpoints, validated with pydantic.

Known fields are range-checked so a bad value is a 400 naming the parameter (router/errors.py turns
pydantic's errors into that), never a worker-side failure. A field that would change the output and that
this server cannot honour (`_REFUSED`: OpenAI's audio, legacy functions, reasoning options; vLLM's beam
search and friends) is refused with a 400 naming it, never ignored; fields with no effect on the output
(``user``, ``metadata``, ``store``, ``service_tier``, ``prediction`` ...) and unknown ones are ignored, as
OpenAI does. Structured outputs: router/surface/structured.py; tools: router/surface/tools.py.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from common.protocol import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, GrammarSpec, SamplingParams, TokenIds
from router.surface.structured import ResponseFormat, grammar_from
from router.surface.tools import MAX_TOOLS, NamedToolChoice, Tool, ToolMode, tool_grammar, tool_mode

__all__ = [
    "MAX_N",
    "MAX_STOP",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
]

MAX_N = 128  # OpenAI's bound on n (sampling evaluations ask for pass@k with n in the tens or hundreds)
# OpenAI allows 4 stop sequences; vLLM any number, and evaluation suites pointed at vLLM send more (lm-eval's
# humaneval: 5, plus the EOS text the harness adds). Bounded: each is matched on every text delta.
MAX_STOP = 64
MAX_PROMPTS = 64  # batched prompts in one /v1/completions call
MAX_CHOICES = 1024  # prompts x n: one upstream request each, so bounded like a batch
_SEED_MAX = 2**63 - 1 - MAX_N  # seed + i (one per choice) must stay a signed 64-bit integer
_SEED_MIN = -(2**63)


class _Lenient(BaseModel):
    # NaN/inf are not JSON but Python's json accepts them; reject instead of comparing NaN to bounds.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Lenient):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far (not only the last chunk).
    continuous_usage_stats: bool = False


# Fields that change the output and that this server does not honour: (values that change nothing, reason).
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "the legacy functions field is not supported: use tools"),
    "function_call": ((None,), "the legacy function_call field is not supported: use tool_choice"),
    "audio": ((None,), "audio output is not supported: this model produces text only"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported: this model does not reason"),
    "verbosity": ((None,), "verbosity is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1, 1.0), "length_penalty (beam search) is not supported"),
    "bad_words": ((None, []), "bad_words is not supported: use logit_bias"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported: use logit_bias or a grammar"),
    "logits_processors": ((None, []), "logits_processors is not supported"),
    "include_stop_str_in_output": ((None, False), "include_stop_str_in_output is not supported"),
    "skip_special_tokens": ((None, True), "skip_special_tokens=false is not supported"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens=false is not supported"),
    "truncate_prompt_tokens": ((None,), "truncate_prompt_tokens is not supported"),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids is not supported"),
    "structural_tag": ((None,), "structural_tag is not supported: use response_format or guided_*"),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern is not supported"),
    "chat_template": ((None,), "a per-request chat_template is not supported"),
    "chat_template_kwargs": ((None, {}), "chat_template_kwargs is not supported"),
    "documents": ((None, []), "documents are not supported"),
}


class _RefusesUnsupported(_Lenient):
    """Declares every `_REFUSED` field (left out of the OpenAPI schema) so that a request using one gets a
    400 naming it."""

    functions: SkipJsonSchema[Any] = None
    function_call: SkipJsonSchema[Any] = None
    audio: SkipJsonSchema[Any] = None
    modalities: SkipJsonSchema[Any] = None
    reasoning_effort: SkipJsonSchema[Any] = None
    verbosity: SkipJsonSchema[Any] = None
    web_search_options: SkipJsonSchema[Any] = None
    use_beam_search: SkipJsonSchema[Any] = None
    length_penalty: SkipJsonSchema[Any] = None
    bad_words: SkipJsonSchema[Any] = None
    allowed_token_ids: SkipJsonSchema[Any] = None
    logits_processors: SkipJsonSchema[Any] = None
    include_stop_str_in_output: SkipJsonSchema[Any] = None
    skip_special_tokens: SkipJsonSchema[Any] = None
    spaces_between_special_tokens: SkipJsonSchema[Any] = None
    truncate_prompt_tokens: SkipJsonSchema[Any] = None
    return_tokens_as_token_ids: SkipJsonSchema[Any] = None
    structural_tag: SkipJsonSchema[Any] = None
    guided_whitespace_pattern: SkipJsonSchema[Any] = None
    chat_template: SkipJsonSchema[Any] = None
    chat_template_kwargs: SkipJsonSchema[Any] = None
    documents: SkipJsonSchema[Any] = None

    @field_validator(*_REFUSED, mode="before")
    @classmethod
    def _refuse(cls, v: Any, info: ValidationInfo) -> None:
        harmless, why = _REFUSED[str(info.field_name)]
        if any(v == h and type(v) is type(h) or (v is None and h is None) for h in harmless):
            return None
        raise ValueError(why)


class _SamplingRequest(_RefusesUnsupported):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model (OpenAI requires it; we do not insist)
    # Completions: each prompt's text before its output; chat (vLLM's): a final assistant message's text before
    # the reply (with a prefilled reply). Declared ahead of max_tokens, whose check reads it.
    echo: bool = False
    max_tokens: int | None = Field(None, ge=0)  # 0: completions' echo alone (`_ECHO_ALONE`)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension; benchmarks use it to get exact output lengths
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extensions.
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=1024)
    # vLLM's request priority: lower is served sooner; 0 (the default) is the deployment's default SLO class,
    # each step up or down one class (common/slo.py). The x-kvferry-class header names a class instead.
    priority: int | None = Field(None, ge=-1000, le=1000)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, max_length=64 * 1024)
    guided_choice: list[str] | None = None
    guided_grammar: str | None = Field(None, max_length=256 * 1024)
    # vLLM's: the prompt's logprobs with this many alternatives per position (the prompt's own token always).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    _ECHO_ALONE: ClassVar[bool] = False  # max_tokens 0 with echo returns the prompt alone (completions)

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and not (cls._ECHO_ALONE and info.data.get("echo")):
            alone = " (0 is allowed with echo: the prompt alone)" if cls._ECHO_ALONE else ""
            raise ValueError(f"max_tokens must be at least 1{alone}")
        return v

    @model_validator(mode="after")
    def _check_prompt_logprobs(self) -> _SamplingRequest:
        if self.prompt_logprobs and self.stream:  # as vLLM: the streamed chunks have no place for them
            raise ValueError("prompt_logprobs is not available when stream is true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):  # "²".isdigit() is true, yet int() refuses it
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias for token {key} is {bias}; biases must lie in [-100, 100]")
        return v

    @property
    def grammar(self) -> GrammarSpec | None:
        """The output constraint (set by `_check_grammar` when the request is validated)."""
        return getattr(self, "_grammar", None)

    @model_validator(mode="after")
    def _check_grammar(self) -> _SamplingRequest:
        grammar, _ = grammar_from(
            self.response_format, self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar
        )
        object.__setattr__(self, "_grammar", grammar)
        return self

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(s == "" for s in items):
            raise ValueError("stop sequences must not be empty")
        return v

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def sampling(
        self,
        max_tokens: int,
        choice: int,
        logprobs: bool,
        top_logprobs: int,
        slo_class: str = "",
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Worker-side sampling parameters for choice ``choice`` (seeded choices get seed + choice, so
        n > 1 gives n different but reproducible samples), of SLO class ``slo_class``; ``prompt_logprobs``: the
        prompt's logprobs with that many alternatives (None: not computed)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        top_k = -1 if self.top_k is None else self.top_k
        if top_p == 0.0:  # OpenAI accepts 0: only the most likely token survives, i.e. greedy
            top_p, top_k = 1.0, 1
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=self.min_p or 0.0,
            seed=None if self.seed is None else self.seed + choice,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            logit_bias=self.logit_bias_ids(),
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=min(self.min_tokens or 0, max_tokens),
            stop_token_ids=self.stop_token_ids or [],
            grammar=self.grammar,
            slo_class=slo_class,
            prompt_logprobs=prompt_logprobs,
        )

    def wanted_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt position the response shows (None: the prompt's logprobs are not shown)."""
        return None if self.stream else self.prompt_logprobs


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    _ECHO_ALONE: ClassVar[bool] = True

    # Token ids as tuples: a request holds its body for its life, and the collector stops walking a tuple of ints
    # after one young collection (common/protocol.py TokenIds).
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: str | list[str] | TokenIds | list[TokenIds]) -> object:
        if not isinstance(v, str):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v, list) and len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if isinstance(v, list) and isinstance(v[0], tuple) and any(not p for p in v):
                raise ValueError("a token-id prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _check_choices(self) -> CompletionRequest:
        prompts = len(self.prompt) if isinstance(self.prompt, list) else 1
        if prompts * self.n > MAX_CHOICES:
            raise ValueError(f"{prompts} prompts x n={self.n} is more than {MAX_CHOICES} choices in one request")
        return self

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self

    @property
    def echo_logprobs(self) -> bool:
        """Echo with logprobs: the legacy logprobs cover the prompt's tokens, then the output's."""
        return self.echo and self.logprobs is not None

    @property
    def echo_only(self) -> bool:
        """Echo with max_tokens 0: the prompt alone comes back (one token is computed and dropped, as vLLM does)."""
        return self.echo and self.max_tokens == 0

    def worker_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt position the workers compute: for the response's prompt_logprobs, echo's
        logprobs, or both (the larger)."""
        wanted = [n for n in (self.wanted_prompt_logprobs(), self.logprobs if self.echo else None) if n is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | TokenIds]:
        """The request's prompts, one per batch entry: text, or token ids."""
        p = self.prompt
        return list(p) if isinstance(p, list) else [p]


class ContentPart(_Lenient):
    type: Literal["text"]
    text: str


class _ToolCallFunction(_Lenient):
    name: str = Field(min_length=1)
    arguments: str = ""


class ToolCallIn(_Lenient):
    """An assistant's earlier tool call, as the history carries it."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: _ToolCallFunction


def _content_parts(v: Any) -> Any:
    """Text parts only, with a clear refusal for images, audio and files (checked before pydantic's union,
    whose error would name the string branch: "Input should be a valid string")."""
    if isinstance(v, list):
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text", "output_text"):
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i} of type {kind!r} needs a 'text' string")
                continue
            if kind in ("image_url", "input_image", "image", "input_audio", "audio_url", "file", "input_file"):
                raise ValueError(f"this model accepts text only (content part {i} has type {kind!r})")
            raise ValueError(f"content part {i} has type {kind!r}; only 'text' parts are supported")
        return [{"type": "text", "text": p["text"]} for p in v]
    return v


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    _parts = field_validator("content", mode="before")(_content_parts)

    @model_validator(mode="after")
    def _check_roles(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs tool_call_id (the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # Parts joined by line breaks, as vLLM renders them: joined with nothing, "Hello" "world" would merge.
        return "\n".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat template options: an assistant turn opened after the messages (the default), or the last
    # message continued as it stands (an assistant reply prefilled by the client).
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _check_template_options(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message continues the last message: set add_generation_prompt to false with it"
            )
        return self

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        if choice in ("required",) and not names:
            raise ValueError("tool_choice 'required' needs tools")
        spec = tool_grammar(
            self.tools or [],
            self.tool_mode,
            choice if isinstance(choice, NamedToolChoice) else None,
            self.parallel_tool_calls is not False,
        )
        if spec is not None:
            if self.grammar is not None:
                raise ValueError(
                    "tool_choice 'required' or a named function cannot be combined with "
                    "response_format or guided_* (both constrain the output)"
                )
            object.__setattr__(self, "_grammar", spec)
        return self

    @property
    def tool_mode(self) -> ToolMode:
        return tool_mode(self.tools, self.tool_choice)

    @property
    def named_tool(self) -> NamedToolChoice | None:
        return self.tool_choice if isinstance(self.tool_choice, NamedToolChoice) else None

    def echo_text(self) -> str | None:
        """What ``echo`` puts before the reply: the last message's text when it is the assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else None

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaced max_tokens in OpenAI's chat API; the newer one wins.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them ("developer" is OpenAI's new name for "system")."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            msg: dict[str, Any] = {"role": role, "content": m.text()}
            if m.name:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
                if m.content is None:
                    msg["content"] = None
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out
