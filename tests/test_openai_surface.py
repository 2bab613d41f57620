"""The OpenAI surface beyond plain text, on CPU: structured outputs, tools, logit_bias, min_tokens, refused
fields, /v1/responses, /tokenize, /detokenize. The official `openai` client against a local cluster (real
redis-server, one prefill and one decode worker running the embedded model, the router), started once for
this module; a long prompt goes through the prefill worker, so the grammar's first token is sampled there
and continued on the decode worker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from common.devcluster.cluster import LocalCluster
from router.surface.tokenizer import RouterTokenizer
from router.surface.tools import NamedToolChoice, Tool, ToolCallStream, parse_tool_calls
from tests.helpers import running_cluster

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
ENV = {
    "KVFERRY_NUM_PAGES": "384",
    "KVFERRY_MAX_PREFILL_TOKENS": "128",
    "KVFERRY_PAGE_SIZE": "16",
    "KVFERRY_ROUTER_LOCAL_PREFIX_FRACTION": "2",  # never prefill a long prompt on the decode pod
    "KVFERRY_MAX_RUNNING": "8",
}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# Small and bounded: the packaged 135M model is weak, so validity has to come from the grammar.
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "enum": ["France", "Spain", "Italy"]},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "is_capital"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}},
        },
    },
]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


# ---- pieces without a cluster --------------------------------------------------------------------------
def _tools() -> list[Tool]:
    return [Tool.model_validate(t) for t in TOOLS]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
    ],
    ids=["hermes", "mistral", "llama3"],
)
def test_auto_tool_calls_are_parsed_from_the_common_formats(text: str) -> None:
    content, calls = parse_tool_calls(text, "auto", _tools())
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    # Streamed: nothing leaks as content, the call comes whole at the end.
    stream = ToolCallStream("auto", _tools(), None)
    pieces = [d for i in range(0, len(text), 7) for d in stream.push(text[i : i + 7])] + stream.finish()
    assert all("content" not in d for d in pieces)
    assert [d["tool_calls"][0]["function"]["name"] for d in pieces] == ["get_weather"]


def test_auto_text_that_is_no_call_stays_content_and_streams() -> None:
    assert parse_tool_calls("It is sunny in Paris.", "auto", _tools()) == ("It is sunny in Paris.", [])
    # An unknown function name is no call either.
    text = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, "auto", _tools()) == (text, [])
    stream = ToolCallStream("auto", _tools(), None)
    assert stream.push("It is") == [{"content": "It is"}]  # streams as soon as it cannot be a call
    assert stream.push(" sunny") == [{"content": " sunny"}] and stream.finish() == []


def test_named_tool_call_streams_its_arguments() -> None:
    choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    stream = ToolCallStream("named", _tools(), choice)
    first = stream.push('{"city": ')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"] == {"arguments": '{"city": '}
    stream.push('"Rome"}')
    stream.finish()
    assert [(c.name, c.arguments) for c in stream.calls] == [("get_time", '{"city": "Rome"}')]


def test_required_calls_are_bounded_and_a_cut_array_keeps_its_complete_calls() -> None:
    from router.surface.tools import MAX_PARALLEL_CALLS, tool_grammar

    tools = _tools()
    for parallel, bound in ((True, 2), (False, 1)):
        spec = tool_grammar(tools, "required", None, parallel)
        assert spec is not None and json.loads(spec.value)["maxItems"] == bound
    many = [Tool.model_validate({"type": "function", "function": {"name": f"f{i}"}}) for i in range(40)]
    assert json.loads(tool_grammar(many, "required", None, True).value)["maxItems"] == MAX_PARALLEL_CALLS
    whole = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", '
    cut = whole + '"arguments": {"city": "Tok'
    content, calls = parse_tool_calls(cut, "required", tools)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    stream = ToolCallStream("required", tools, None)
    pieces = [d for i in range(0, len(cut), 9) for d in stream.push(cut[i : i + 9])] + stream.finish()
    assert [d["tool_calls"][0]["function"]["name"] for d in pieces] == ["get_weather"]
    assert parse_tool_calls('[{"name": "get_we', "required", tools) == ('[{"name": "get_we', [])  # none complete


def test_tool_history_renders_through_a_template_without_tool_support(smol_path) -> None:
    tok = RouterTokenizer.from_dir(smol_path)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ]
    text = tok.decode(tok.encode_chat(messages, _tools()))
    assert "<tools>" in text and '"get_weather"' in text  # the tools, in the system message
    assert "<tool_call>" in text and "<tool_response>\n18 C, sunny\n</tool_response>" in text


# ---- the cluster ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(prefill=1, decode=1, env=ENV, wait_up=False) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="none", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def tok(smol_path) -> RouterTokenizer:
    return RouterTokenizer.from_dir(smol_path)


def test_json_schema_output_validates_streamed_and_not_with_n_2(client: openai.OpenAI) -> None:
    fmt = _schema_format(CITY_SCHEMA)
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=80, n=2, temperature=1.0, seed=5, response_format=fmt
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), CITY_SCHEMA)
    chunks = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=80, temperature=0, response_format=fmt, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), CITY_SCHEMA)


def test_json_object_and_guided_json_parse(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["Paris", "Lyon"]}}}
    c = client.completions.create(
        model=MODEL, prompt="The capital of France, as JSON:", max_tokens=40, extra_body={"guided_json": schema}
    )
    jsonschema.validate(json.loads(c.choices[0].text), schema)


def test_guided_choice_and_regex(client: openai.OpenAI) -> None:
    choices = ["Paris", "London", "Rome"]
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=FRANCE,
            max_tokens=10,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": choices},
        )
        assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model=MODEL, prompt="A date: ", max_tokens=20, extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"}
    )
    text = r.choices[0].text
    assert len(text) == 7 and text.startswith("20") and text[4] == "-", text


def test_named_tool_choice_yields_that_call_with_valid_arguments(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL, messages=WEATHER, max_tokens=60, temperature=0, tools=TOOLS, tool_choice=choice
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    # Streamed: tool_calls deltas whose arguments concatenate to the same valid JSON.
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=WEATHER, max_tokens=60, temperature=0, tools=TOOLS, tool_choice=choice, stream=True
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_choice_and_the_conversation_after_it(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER,
        max_tokens=80,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    (call,) = r.choices[0].message.tool_calls
    params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), params)
    history = [
        *WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    after = client.chat.completions.create(model=MODEL, messages=history, max_tokens=20, temperature=0, tools=TOOLS)
    assert after.choices[0].message.content or after.choices[0].message.tool_calls


def test_parallel_required_calls_come_back_whole(client: openai.OpenAI) -> None:
    """Parallel calls on (the default) with two tools: the list ends within its bound (one call per tool) and
    comes back as tool_calls; cut by max_tokens, the complete calls still do, with finish_reason "length"."""
    ask = [
        {
            "role": "user",
            "content": "What's the weather in Paris in celsius, and what time is it in Tokyo? Call both tools.",
        }
    ]
    kw = dict(model=MODEL, messages=ask, temperature=0, tools=TOOLS, tool_choice="required")
    r = client.chat.completions.create(max_tokens=200, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert 1 <= len(calls) <= 2
    for call in calls:
        params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), params)
    # Cut inside the last call: the ones before it come back; the cut one is dropped.
    cut = client.chat.completions.create(max_tokens=r.usage.completion_tokens - 4, **kw).choices[0]
    assert cut.finish_reason == "length"
    kept = [(c.function.name, c.function.arguments) for c in cut.message.tool_calls or []]
    assert kept == [(c.function.name, c.function.arguments) for c in calls[:-1]]


def test_logit_bias_bans_the_greedy_token_and_forces_another(client: openai.OpenAI, tok: RouterTokenizer) -> None:
    base = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=3, temperature=0, logprobs=True)
    first = base.choices[0].logprobs.content[0].token
    (banned,) = tok.encode(first, add_special_tokens=False)
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=3, temperature=0, logprobs=True, logit_bias={str(banned): -100}
    )
    assert r.choices[0].logprobs.content[0].token != first
    forced = tok.encode(" kvferry", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logit_bias={str(forced): 100})
    assert r.choices[0].text == tok.decode([forced] * 4)


def test_min_tokens_holds_back_the_end(client: openai.OpenAI) -> None:
    hi = [{"role": "user", "content": "Say hi."}]
    free = client.chat.completions.create(model=MODEL, messages=hi, max_tokens=40, temperature=0)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 25
    held = client.chat.completions.create(
        model=MODEL, messages=hi, max_tokens=40, temperature=0, extra_body={"min_tokens": 25}
    )
    assert held.usage.completion_tokens >= 25
    rep = client.chat.completions.create(
        model=MODEL, messages=hi, max_tokens=40, temperature=0, extra_body={"repetition_penalty": 1.5}
    )
    assert rep.choices[0].message.content != free.choices[0].message.content


def test_disaggregated_request_with_a_grammar_is_valid(client: openai.OpenAI, cluster: LocalCluster) -> None:
    """A prompt above the router's disaggregation threshold: the prefill worker samples the first token under
    the grammar, the decode worker rebuilds the matcher, replays it and continues."""
    before = httpx.get(f"{cluster.router_url}/router/workers").json()["decisions"].get("disaggregated", 0)
    story = "The quick brown fox jumps over the lazy dog near the river bank. " * 30
    messages = [{"role": "user", "content": f"{story}\nWhich animal jumps? Answer as JSON."}]
    schema = {
        "type": "object",
        "properties": {"animal": {"type": "string", "enum": ["fox", "dog", "cat"]}, "count": {"type": "integer"}},
        "required": ["animal", "count"],
    }
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, response_format=_schema_format(schema)
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.usage.prompt_tokens > 256
    after = httpx.get(f"{cluster.router_url}/router/workers").json()["decisions"].get("disaggregated", 0)
    assert after == before + 1


# ---- refusals and errors -------------------------------------------------------------------------------
BAD_CHAT_BODIES = [
    ({"logit_bias": {"Paris": -100}}, "logit_bias"),
    ({"logit_bias": {"12": 250}}, "logit_bias"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"response_format": {"type": "bogus"}}, "response_format.type"),
    ({"response_format": _schema_format({"type": "strng"})}, None),
    ({"extra": {"guided_regex": "("}}, None),
    ({"extra": {"guided_grammar": "root ::= "}}, None),  # the worker's compiler refuses it: still a 400
    ({"extra": {"guided_regex": "(?<=a)b"}}, None),  # Python's re takes it, the grammar compiler does not
    # A character no token of this model spells (an unassigned code point whose bytes the tokenizer never learnt):
    # the grammar allows no token at all, the request's fault, whichever worker runs it.
    ({"extra": {"guided_regex": "\U00040000"}}, None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
        None,
    ),
    ({"messages": [{"role": "user", "content": "caf\ud800"}]}, "messages"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT_BODIES, ids=[str(i) for i in range(len(BAD_CHAT_BODIES))])
def test_invalid_requests_are_400_in_openai_shape(cluster: LocalCluster, body: dict, param: str | None) -> None:
    body = dict(body)
    full = {"model": MODEL, "messages": FRANCE, "max_tokens": 5, **body.pop("extra", {}), **body}
    # json.dumps escapes a lone surrogate as \ud800, as a client's JSON would carry it.
    r = httpx.post(
        f"{cluster.router_url}/v1/chat/completions",
        content=json.dumps(full),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if "image_url" in json.dumps(body):
        assert "this model accepts text only" in err["message"]
    if "\ud800" in json.dumps(body, ensure_ascii=False):
        assert "surrogate" in err["message"]


# Every field of OpenAI's chat and completions request schemas (and the vLLM extensions we take), with a
# value that would change the output: it works (200) or is refused with a 400 naming it.
SUPPORTED_CHAT = {
    "frequency_penalty": 0.5,
    "logit_bias": {"12": 1},
    "logprobs": True,
    "max_completion_tokens": 4,
    "max_tokens": 4,
    "metadata": {"k": "v"},
    "n": 2,
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "Paris"},
    "presence_penalty": 0.5,
    "prompt_cache_key": "k",
    "response_format": {"type": "json_object"},
    "safety_identifier": "s",
    "seed": 3,
    "service_tier": "auto",
    "stop": ["\n"],
    "store": False,
    "stream": False,
    "temperature": 0.5,
    "tool_choice": "none",
    "tools": TOOLS,
    "top_logprobs": 2,
    "top_p": 0.9,
    "user": "u",
    "min_tokens": 2,
    "repetition_penalty": 1.1,
    "stop_token_ids": [2],
    "guided_choice": ["a", "b"],
    "add_generation_prompt": False,
    "prompt_logprobs": 2,
}
REFUSED_CHAT = {
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "modalities": ["text", "audio"],
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
    "use_beam_search": True,
    "skip_special_tokens": False,
    "chat_template": "{{ messages }}",
}


@pytest.mark.parametrize("field", sorted({**SUPPORTED_CHAT, **REFUSED_CHAT}))
def test_every_chat_field_works_or_is_refused_by_name(cluster: LocalCluster, field: str) -> None:
    value = {**SUPPORTED_CHAT, **REFUSED_CHAT}[field]
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    r = httpx.post(f"{cluster.router_url}/v1/chat/completions", json=body, timeout=120)
    if field in SUPPORTED_CHAT:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize(
    "field,value,ok",
    [
        ("best_of", 1, True),
        ("echo", True, True),
        ("suffix", "x", False),
        ("logprobs", 2, True),
        ("logit_bias", {"12": -1}, True),
        ("seed", 1, True),
        ("stream_options", {"include_usage": True}, False),  # only with stream: true
        ("use_beam_search", True, False),
        ("response_format", {"type": "json_object"}, True),
        ("prompt_logprobs", 1, True),
    ],
)
def test_completions_fields_work_or_are_refused(cluster: LocalCluster, field: str, value: object, ok: bool) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, field: value}
    r = httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == (200 if ok else 400), r.text


# ---- more routes ---------------------------------------------------------------------------------------
def test_responses_api_text_streaming_and_tools(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=16
    )
    assert r.object == "response" and "Paris" in r.output_text and r.usage.output_tokens > 0
    events = list(
        client.responses.create(
            model=MODEL, input=[{"role": "user", "content": "Say hi."}], temperature=0, max_output_tokens=8, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text and deltas
    tool = {"type": "function", **TOOLS[0]["function"]}
    r = client.responses.create(
        model=MODEL,
        input="Weather in Rome?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    r = client.responses.create(
        model=MODEL,
        input="The capital of France as JSON.",
        text={"format": {"type": "json_schema", "name": "c", "schema": CITY_SCHEMA, "strict": True}},
        max_output_tokens=80,
        temperature=0,
    )
    jsonschema.validate(json.loads(r.output_text), CITY_SCHEMA)


def test_tokenize_and_detokenize(cluster: LocalCluster, tok: RouterTokenizer) -> None:
    r = httpx.post(f"{cluster.router_url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    chat = httpx.post(f"{cluster.router_url}/tokenize", json={"messages": FRANCE}).json()
    assert chat["tokens"] == tok.encode_chat(FRANCE)
    back = httpx.post(f"{cluster.router_url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    assert httpx.post(f"{cluster.router_url}/detokenize", json={"tokens": [-1]}).status_code == 400


def test_assistant_prefill_continues_the_final_message(client: openai.OpenAI, cluster: LocalCluster) -> None:
    """vLLM's continue_final_message: the prompt ends inside the assistant's prefilled reply (no turn closed,
    none opened), so the answer continues it: the same text as the completions endpoint gives for those ids."""
    prefill = [*FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(f"{cluster.router_url}/tokenize", json={"messages": prefill, **flags}).json()["tokens"]
    opened = httpx.post(f"{cluster.router_url}/tokenize", json={"messages": prefill}).json()["tokens"]
    assert len(ids) < len(opened)  # neither the end of the assistant turn nor a new one
    chat = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=8, temperature=0, extra_body=flags)
    assert chat.usage.prompt_tokens == len(ids)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text
    # vLLM's echo: the prefilled text comes back ahead of its continuation, whole or streamed.
    whole = prefill[-1]["content"] + plain.choices[0].text
    kw = dict(model=MODEL, messages=prefill, max_tokens=8, temperature=0, extra_body={**flags, "echo": True})
    assert client.chat.completions.create(**kw).choices[0].message.content == whole  # type: ignore[call-overload]
    chunks = client.chat.completions.create(stream=True, **kw)  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
