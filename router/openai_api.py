"""Request bodies of the OpenAI endpoints, validated with pydantic.

Unknown fields are ignored, as OpenAI does (clients send ``user``, ``logit_bias``, ``tools`` and newer
fields we do not act on); known fields are range-checked so a bad value is a 400 naming the parameter
(router/errors.py turns pydantic's errors into that), never a worker-side failure.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.protocol import MAX_TOP_LOGPROBS, SamplingParams

__all__ = [
    "MAX_N",
    "MAX_STOP",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
]

MAX_N = 16  # choices per request: n upstream requests, so bounded like a batch
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_PROMPTS = 64  # batched prompts in one /v1/completions call
_SEED_MAX = 2**63 - 1 - MAX_N  # seed + i (one per choice) must stay a signed 64-bit integer
_SEED_MIN = -(2**63)


class _Lenient(BaseModel):
    # NaN/inf are not JSON but Python's json accepts them; reject instead of comparing NaN to bounds.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingRequest(_Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model (OpenAI requires it; we do not insist)
    max_tokens: int | None = Field(None, ge=1)
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

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self, max_tokens: int, choice: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
        """Worker-side sampling parameters for choice ``choice`` (seeded choices get seed + choice, so
        n > 1 gives n different but reproducible samples)."""
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
        )


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: str | list[str] | list[int] | list[list[int]]) -> object:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], (str, list)) and len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("a token-id prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one per batch entry: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Lenient):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"content part type {self.type!r} is not supported (only 'text')")
        return self


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaced max_tokens in OpenAI's chat API; the newer one wins.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template expects them ("developer" is OpenAI's new name for "system")."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            msg = {"role": role, "content": m.text()}
            if m.name:
                msg["name"] = m.name
            out.append(msg)
        return out
