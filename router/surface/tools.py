"""Tool calling: the request's tools as the chat template sees them, the grammar that forces a call, and
tool calls parsed out of the model's text (whole responses and streamed deltas).

`tool_choice` decides the shape of the output:
- "none" or no tools: plain text;
- "auto": free text; a call written in one of the common formats (Hermes/Qwen ``<tool_call>{...}</tool_call>``,
  Mistral ``[TOOL_CALLS] [...]``, Llama 3.x's bare ``{"name": ..., "parameters": ...}``) is parsed out;
- "required": the grammar forces a JSON array of calls ``[{"name": ..., "arguments": {...}}]``, each valid for
  its function's parameters: one call when parallel_tool_calls is false, else at most one per tool offered
  (`max_parallel_calls`: a bound the grammar holds the model to, so the list always ends). Cut by
  max_tokens, the complete calls come back as tool_calls (finish_reason "length"); the cut one is dropped;
- a named function: the grammar forces that function's arguments object; the call is built around it.
Templates that do not take tools (no ``tools`` in their text) get them Hermes-style in the system message,
and assistant tool calls / tool results as text in that format.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.protocol import GrammarSpec

__all__ = [
    "MAX_PARALLEL_CALLS",
    "MAX_TOOLS",
    "NamedToolChoice",
    "Tool",
    "ToolCall",
    "ToolCallStream",
    "ToolMode",
    "finish_reason_with_calls",
    "max_parallel_calls",
    "parse_tool_calls",
    "render_for_template",
    "tool_grammar",
    "tool_mode",
]

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 16  # the most calls one forced array may hold, however many tools are offered


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class FunctionDef(_Model):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            from router.surface.structured import check_json_schema

            check_json_schema(v)
        return v


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: _NamedFunction


ToolMode = Literal["none", "auto", "required", "named"]


def tool_mode(tools: list[Tool] | None, choice: str | NamedToolChoice | None) -> ToolMode:
    if not tools or choice == "none":
        return "none"
    if isinstance(choice, NamedToolChoice):
        return "named"
    return "required" if choice == "required" else "auto"


def _parameters(f: FunctionDef) -> dict[str, Any]:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


def max_parallel_calls(tools: list[Tool], parallel: bool) -> int:
    """How many calls a "required" array may hold: one per tool offered (capped), one without parallel calls."""
    return min(len(tools), MAX_PARALLEL_CALLS) if parallel else 1


def tool_grammar(
    tools: list[Tool], mode: ToolMode, choice: NamedToolChoice | None, parallel: bool
) -> GrammarSpec | None:
    """The grammar that makes the output a valid call ("required", "named"); None for free text."""
    if mode == "named":
        assert choice is not None
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        return GrammarSpec(kind="json_schema", value=json.dumps(_parameters(fn)))
    if mode == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t.function)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "maxItems": max_parallel_calls(tools, parallel),
            "items": {"anyOf": calls},
        }
        return GrammarSpec(kind="json_schema", value=json.dumps(schema))
    return None


# ---- the prompt --------------------------------------------------------------------------------------
def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def _hermes_system(tools: list[Tool]) -> str:
    lines = "\n".join(json.dumps(t) for t in template_tools(tools))
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")}) + "\n</tool_call>"


def render_for_template(
    messages: list[dict[str, Any]], tools: list[Tool] | None, template: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render with `template`. A template that takes tools gets them as they are (tool
    call arguments as objects, as templates print them with ``tojson``); one that does not gets the tools
    in its system message and the calls and results as Hermes-style text."""
    if "tools" in template and "tool_calls" in template:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [_call_with_object_arguments(c) for c in m["tool_calls"]]
            out.append(m)
        return out, template_tools(tools) if tools else None
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            texts = [m["content"]] if m.get("content") else []
            m["content"] = "\n".join(texts + [_call_text(c) for c in calls])
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if tools:
        preamble = _hermes_system(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, None


def _call_with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass
    return {**call, "function": fn}


# ---- the output ----------------------------------------------------------------------------------------
@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters"))
    if not isinstance(name, str) or name not in names:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _calls_from(value: Any, names: set[str]) -> list[ToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = [_call_from(v, names) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _complete_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """The complete calls at the start of a JSON array of calls that was cut short (None when none is)."""
    decoder = json.JSONDecoder()
    s = text.lstrip()
    if not s.startswith("["):
        return None
    calls: list[ToolCall] = []
    i = 1
    while True:
        while i < len(s) and s[i] in " \t\r\n,":
            i += 1
        try:
            obj, i = decoder.raw_decode(s, i)
        except ValueError:
            break
        call = _call_from(obj, names)
        if call is None:
            break
        calls.append(call)
    return calls or None


_TAG_OPEN, _TAG_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL = "[TOOL_CALLS]"
_MARKERS = (_TAG_OPEN, _MISTRAL, "{")


def parse_tool_calls(
    text: str, mode: ToolMode, tools: list[Tool], choice: NamedToolChoice | None = None
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from a whole output. Text that holds no well-formed call is content."""
    names = {t.function.name for t in tools}
    if mode == "named":
        assert choice is not None
        return None, [ToolCall(choice.function.name, text.strip())]
    if mode == "required":
        try:
            calls = _calls_from(json.loads(text), names)
        except ValueError:  # cut by max_tokens (the grammar makes any other output a whole array)
            calls = _complete_calls(text, names)
        return (None, calls) if calls else (text, [])
    if mode != "auto":
        return text, []
    stripped = text.strip()
    if _TAG_OPEN in stripped:
        head, _, rest = stripped.partition(_TAG_OPEN)
        calls: list[ToolCall] = []
        for block in (_TAG_OPEN + rest).split(_TAG_OPEN)[1:]:
            body = block.split(_TAG_CLOSE, 1)[0].strip()
            try:
                found = _calls_from(json.loads(body), names)
            except ValueError:
                found = None
            if not found:
                return text, []
            calls += found
        return (head.strip() or None), calls
    if stripped.startswith(_MISTRAL):
        try:
            calls2 = _calls_from(json.loads(stripped[len(_MISTRAL) :].strip()), names)
        except ValueError:
            calls2 = None
        return (None, calls2) if calls2 else (text, [])
    if stripped.startswith("{") or stripped.startswith("["):
        try:
            calls3 = _calls_from(json.loads(stripped), names)
        except ValueError:
            calls3 = None
        if calls3:
            return None, calls3
    return text, []


class ToolCallStream:
    """One streamed choice with tools: text deltas in, OpenAI delta objects out.

    A named call streams its arguments as they come (the grammar makes the whole output the arguments).
    "required" and "auto" hold text back while it may still be a call (it starts like one); once it cannot
    be, it streams as content; a call is sent whole when the output ends.
    """

    def __init__(self, mode: ToolMode, tools: list[Tool], choice: NamedToolChoice | None) -> None:
        self.mode = mode
        self.tools = tools
        self.choice = choice
        self.held = ""
        self.streaming_content = mode == "none"
        self.named: ToolCall | None = None
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> list[dict[str, Any]]:
        if self.mode == "named":
            out = []
            if self.named is None:
                assert self.choice is not None
                self.named = ToolCall(self.choice.function.name, "")
                head = {"index": 0, "id": self.named.id, "type": "function"}
                out.append({"tool_calls": [{**head, "function": {"name": self.named.name, "arguments": ""}}]})
            if text:
                self.named.arguments += text
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if self.streaming_content:
            return [{"content": text}] if text else []
        self.held += text
        if self.mode == "auto" and not self._may_be_call(self.held):
            self.streaming_content = True
            held, self.held = self.held, ""
            return [{"content": held}]
        return []

    def _may_be_call(self, text: str) -> bool:
        s = text.lstrip()
        if not s:
            return True
        return any(s.startswith(m) or m.startswith(s) for m in _MARKERS) or s.startswith("[")

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for what was held back, once the output is complete."""
        if self.mode == "named" or self.streaming_content:
            if self.mode == "named" and self.named is not None:
                self.calls = [self.named]
            return []
        content, calls = parse_tool_calls(self.held, self.mode, self.tools, self.choice)
        self.calls = calls
        out: list[dict[str, Any]] = []
        if content:
            out.append({"content": content})
        for i, c in enumerate(calls):
            out.append({"tool_calls": [{"index": i, **c.as_dict()}]})
        return out


def finish_reason_with_calls(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's "tool_calls" when the output ended (not cut by length) as calls."""
    return "tool_calls" if calls and reason == "stop" else reason
