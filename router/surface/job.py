"""The records of one request in the pipeline (router/surface/service.py): the job, its admission, its choices."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from common.protocol import TokenIds, TokenLine
from router.metrics import TokenGaps
from router.surface.choice import ChoiceState, TokenInfo
from router.surface.openai_api import ChatCompletionRequest, CompletionRequest
from router.surface.tools import ToolCallStream
from router.timeline import RequestRecord
from router.upstream.migration import MigratingCall

__all__ = ["Admission", "Job", "RunningChoice"]


@dataclass
class Job:
    kind: Literal["chat", "completion"]
    rid: str
    created: int
    model: str
    request: ChatCompletionRequest | CompletionRequest
    prompts: list[TokenIds]  # tuples: what the collector need not walk (common/protocol.py)
    max_tokens: list[int]  # per prompt
    n: int
    stops: list[str]
    logprobs: bool
    top_logprobs: int
    include_usage: bool
    continuous_usage: bool = False  # every stream chunk carries its choice's usage so far
    # echo: each prompt's text before its output (completions), the final assistant message's before the reply (chat)
    echo: list[str] = field(default_factory=list)
    # The prompt's logprobs: alternatives per position the workers compute (None: none), whether completions'
    # echo shows them in the legacy logprobs, and the vLLM `prompt_logprobs` the response carries (None: none).
    worker_prompt_logprobs: int | None = None
    echo_logprobs: bool = False
    prompt_logprobs: int | None = None
    echo_only: bool = False  # completions' echo with max_tokens 0: the prompt alone, the computed token dropped
    slo_class: str = ""  # its SLO class (common/slo.py), from `priority` or the x-kvferry-class header
    record: RequestRecord | None = None  # timeline, trace and metrics of the request (router/timeline.py)
    # Every choice started, registered before its first await: the job's owner closes them however it ends.
    choices: list[RunningChoice] = field(default_factory=list)


class Admission:
    """One admitted request (an identity: the live set of these is the router's in-flight count)."""

    __slots__ = ()


@dataclass
class RunningChoice:
    index: int
    prompt_index: int
    call: MigratingCall
    state: ChoiceState
    first: TokenLine | None = None
    text: list[str] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    offset: int = 0  # completions' text_offset of the next token
    echoed: bool = False  # the prompt's text (echo) has gone out ahead of the output
    gaps: TokenGaps | None = None  # inter-token gaps, for the router's histogram
    tools: ToolCallStream | None = None  # chat with tools: tool calls parsed out of the text
