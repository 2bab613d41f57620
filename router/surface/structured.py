"""Structured outputs at the router: OpenAI's ``response_format`` and vLLM's ``guided_*`` become one
`GrammarSpec`. The router checks what it can without the grammar library (it brings torch): schemas against
their meta-schema, regexes compile; the worker refuses (400) what its compiler does not support.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common import settings_registry as reg
from common.protocol import GrammarSpec

__all__ = [
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "LIMITS",
    "GrammarLimits",
    "JsonSchemaFormat",
    "ResponseFormat",
    "check_json_schema",
    "check_schema_limits",
    "choice_grammar",
    "grammar_from",
]

MAX_CHOICES = 256
# Schemas are refused beyond these before anything walks them recursively (95 levels exhausted Python's stack
# in the check and the compiler); docs/reliability.md lists them.
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays, the outermost counting 1
MAX_SCHEMA_BYTES = 256 * 1024  # as compact JSON


@dataclass(frozen=True)
class GrammarLimits(reg.EnvFields):
    """What a grammar may hold, checked before the worker compiles it (compile time grows with these)."""

    schema_max_properties: int = reg.ROUTER_SCHEMA_MAX_PROPERTIES.field()
    schema_max_enum_values: int = reg.ROUTER_SCHEMA_MAX_ENUM_VALUES.field()
    schema_max_enum_chars: int = reg.ROUTER_SCHEMA_MAX_ENUM_CHARS.field()
    grammar_max_bytes: int = reg.ROUTER_GRAMMAR_MAX_BYTES.field()


LIMITS = GrammarLimits.from_env()  # read once: validation runs inside the request models, with no options at hand


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


@lru_cache(maxsize=256)
def _check_schema_text(text: str) -> None:
    from jsonschema import exceptions, validators

    schema = json.loads(text)
    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except exceptions.SchemaError as e:
        path = "/".join(str(p) for p in e.path)
        raise ValueError(f"invalid JSON schema{f' at {path}' if path else ''}: {e.message}") from None


def _depth_within(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects and arrays at most ``limit`` deep (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return True


def _schema_counts(schema: Any) -> tuple[int, int, int]:
    """(properties, enum values and consts, their strings' characters) in the schema, walked without recursion."""
    properties = values = chars = 0
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict):
            properties += len(props)
        listed = node.get("enum")
        found = list(listed) if isinstance(listed, list) else []
        if "const" in node:
            found.append(node["const"])
        values += len(found)
        chars += sum(len(v) for v in found if isinstance(v, str))
        # Everything else may hold schemas (a property may be named "enum"): over-counting only.
        stack.extend(
            v for k, v in node.items() if isinstance(v, (dict, list)) and not (k == "enum" and isinstance(v, list))
        )
    return properties, values, chars


def check_schema_limits(schema: Any, limits: GrammarLimits | None = None) -> str:
    """The schema as compact JSON; ValueError naming the limit it exceeds."""
    limits = limits or LIMITS
    if not _depth_within(schema, MAX_SCHEMA_DEPTH):
        raise ValueError(
            f"the JSON schema nests JSON objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels (the limit)"
        )
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise ValueError(f"the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes (the limit)")
    properties, values, chars = _schema_counts(schema)
    if properties > limits.schema_max_properties:
        raise ValueError(
            f"the JSON schema has {properties} object properties, more than {limits.schema_max_properties} (the "
            "limit, KVFERRY_ROUTER_SCHEMA_MAX_PROPERTIES)"
        )
    if values > limits.schema_max_enum_values:
        raise ValueError(
            f"the JSON schema has {values} enum values, more than {limits.schema_max_enum_values} (the limit, "
            "KVFERRY_ROUTER_SCHEMA_MAX_ENUM_VALUES)"
        )
    if chars > limits.schema_max_enum_chars:
        raise ValueError(
            f"the JSON schema's enum strings have {chars} characters, more than {limits.schema_max_enum_chars} "
            "(the limit, KVFERRY_ROUTER_SCHEMA_MAX_ENUM_CHARS)"
        )
    return text


def _check_grammar_size(text: str, param: str) -> None:
    size = len(text.encode())
    if size > LIMITS.grammar_max_bytes:
        raise ValueError(
            f"{param} is {size} bytes, more than {LIMITS.grammar_max_bytes} (the limit, KVFERRY_ROUTER_GRAMMAR_MAX_BYTES)"
        )


def check_json_schema(schema: Any) -> None:
    """ValueError unless `schema` is a JSON schema within the limits (checked once per distinct schema)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    _check_schema_text(check_schema_limits(schema))


def _json_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        if len(value.encode()) > MAX_SCHEMA_BYTES:
            raise ValueError(f"{param}: the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes (the limit)")
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{param}: the schema is not valid JSON") from None
        except RecursionError:
            raise ValueError(
                f"{param}: the JSON schema nests JSON objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels (the limit)"
            ) from None
    try:
        check_json_schema(value)
    except ValueError as e:
        raise ValueError(f"{param}: {e}") from None
    return json.dumps(value)


def choice_grammar(choices: list[str]) -> GrammarSpec:
    """Exactly one of `choices` (EBNF string literals, escaped as JSON strings are)."""
    if not choices or len(choices) > MAX_CHOICES:
        raise ValueError(f"guided_choice needs 1 to {MAX_CHOICES} choices")
    if any(c == "" for c in choices):
        raise ValueError("guided_choice choices must not be empty")
    chars = sum(len(c) for c in choices)
    if chars > LIMITS.schema_max_enum_chars:
        raise ValueError(
            f"guided_choice choices have {chars} characters, more than {LIMITS.schema_max_enum_chars} (the limit, "
            "KVFERRY_ROUTER_SCHEMA_MAX_ENUM_CHARS)"
        )
    return GrammarSpec(kind="ebnf", value="root ::= " + " | ".join(json.dumps(c) for c in choices))


def grammar_from(
    response_format: ResponseFormat | None,
    guided_json: Any = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
) -> tuple[GrammarSpec | None, str | None]:
    found: list[tuple[GrammarSpec, str]] = []
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append((GrammarSpec(kind="json_object"), "response_format"))
        else:
            fmt = response_format.json_schema
            if fmt is None or fmt.schema_ is None:
                raise ValueError("response_format: type json_schema needs json_schema.schema")
            found.append(
                (GrammarSpec(kind="json_schema", value=_json_text(fmt.schema_, "response_format")), "response_format")
            )
    if guided_json is not None:
        found.append((GrammarSpec(kind="json_schema", value=_json_text(guided_json, "guided_json")), "guided_json"))
    if guided_regex is not None:
        _check_grammar_size(guided_regex, "guided_regex")
        try:
            re.compile(guided_regex)
        except re.error as e:
            raise ValueError(f"guided_regex is not a valid regular expression: {e}") from None
        found.append((GrammarSpec(kind="regex", value=guided_regex), "guided_regex"))
    if guided_choice is not None:
        found.append((choice_grammar(guided_choice), "guided_choice"))
    if guided_grammar is not None:
        if not guided_grammar.strip():
            raise ValueError("guided_grammar must not be empty")
        _check_grammar_size(guided_grammar, "guided_grammar")
        found.append((GrammarSpec(kind="ebnf", value=guided_grammar), "guided_grammar"))
    if len(found) > 1:
        raise ValueError(f"only one output constraint per request: got {', '.join(p for _, p in found)}")
    return (found[0][0], found[0][1]) if found else (None, None)
