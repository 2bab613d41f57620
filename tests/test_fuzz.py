"""Bad input against a real local cluster (redis-server, 1 prefill + 1 decode worker, the router) over real
HTTP: a schemathesis pass over the router's own OpenAPI schema, hypothesis-generated request bodies,
explicit nasty cases, and malformed protocol messages to both workers' internal endpoints (including a
real NIXL handshake from this process, so the prefill worker's checks behind the handshake are reached).

The property everywhere: no 5xx, no crash (the workers stay healthy and keep serving), and every error
body in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Valid requests are kept cheap: the cluster's pools are small (a huge ``max_tokens`` is refused by the
decode worker instead of generated), chat defaults to 4 tokens, and generated bodies that ask for a
mid-sized ``max_tokens`` or ``n`` get 4 and 2 (every other value goes through as generated).
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from common.devcluster.cluster import LocalCluster
from tests.helpers import assert_openai_error, running_cluster, wait_pages_back
from tests.workers import prefill_layout, prefill_request

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"
NUM_PAGES = 128  # 2048 tokens per worker: a max_tokens that fits the context but not the pool is a 400
ENV = {
    "KVFERRY_NUM_PAGES": str(NUM_PAGES),
    "KVFERRY_MAX_PREFILL_TOKENS": "256",
    "KVFERRY_ROUTER_DEFAULT_MAX_TOKENS": "4",
}
INPUTS: dict[str, int] = {}


def _count(kind: str) -> None:
    INPUTS[kind] = INPUTS.get(kind, 0) + 1


# ---- the shared cluster --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    try:
        with running_cluster(prefill=1, decode=1, env=ENV, wait_up=False) as c:
            yield c
            # Whatever was thrown at them, the workers are alive, hold no request and no page.
            for url in c.prefill_urls + c.decode_urls:
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200, url
            wait_pages_back(*c.prefill_urls, *c.decode_urls)
    finally:
        print(f"\ninputs tried: {sum(INPUTS.values())} {dict(sorted(INPUTS.items()))}")


@pytest.fixture(scope="module")
def http(cluster: LocalCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.router_url, timeout=60) as client:
        yield client


def check_response(r: httpx.Response | Any, what: object = "") -> None:
    """No 5xx; a 4xx has an OpenAI error body (and a JSON content type)."""
    status = r.status_code
    assert status < 500, (what, status, r.text[:500])
    if status >= 400:
        ctype = next((v for k, v in r.headers.items() if k.lower() == "content-type"), "")
        ctype = ctype[0] if isinstance(ctype, list) else ctype  # schemathesis: header -> list of values
        assert ctype.startswith("application/json"), (what, r.headers)
        assert_openai_error(r.json())


_INT = TypeAdapter(int)


def _as_int(v: Any) -> int | None:
    """What the router's lax pydantic int would make of `v` (None: not an int to it)."""
    try:
        return _INT.validate_python(v)
    except (ValidationError, TypeError, ValueError):
        return None


def tame(body: Any) -> Any:
    """Keeps generated bodies cheap to serve: a max_tokens that the router would accept and that could
    take seconds to generate becomes 4, an n above 2 becomes 2. Everything else passes through untouched."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            v = _as_int(body.get(key))
            if v is not None and 4 < v <= NUM_PAGES * 16:  # above: the worker refuses it (pool)
                body[key] = 4
        v = _as_int(body.get("n"))
        if v is not None and 2 < v <= 16:
            body["n"] = 2
    return body


# ---- schemathesis over the router's OpenAPI schema ---------------------------------------------------
@pytest.fixture(scope="module")
def api_schema(cluster: LocalCluster) -> Any:
    schema = schemathesis.openapi.from_url(f"{cluster.router_url}/openapi.json")
    schema.config.generation.update(max_examples=40)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_openapi_schema_fuzz(case: Any, cluster: LocalCluster) -> None:
    case.body = tame(case.body)
    _count(f"schemathesis {case.method} {case.path}")
    response = case.call(base_url=cluster.router_url, timeout=60)
    check_response(response, (case.method, case.formatted_path, case.body))
    case.validate_response(response, checks=[schemathesis.checks.not_a_server_error])


# ---- hypothesis-generated bodies ------------------------------------------------------------------
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["", "0", "-1", "1e309", "NaN", "user", "system", MODEL, "\x00", "\ud800"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "", "USER", "bot"])
messages = st.lists(
    st.fixed_dictionaries(
        {"role": roles | json_values},
        optional={
            "content": st.text(max_size=40)
            | json_values
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]) | json_values},
                    optional={"text": st.text(max_size=20) | json_values},
                ),
                max_size=3,
            ),
            "name": st.text(max_size=10) | json_values,
        },
    ),
    max_size=4,
)
SAMPLING_FIELDS = {
    "model": st.just(MODEL) | json_values,
    "max_tokens": st.integers(-5, 5) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5) | json_values,
    "top_k": st.integers(-3, 100) | json_values,
    "min_p": json_values,
    "seed": st.integers() | json_values,
    "n": st.integers(-1, 20) | json_values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=6) | json_values,
    "frequency_penalty": json_values,
    "presence_penalty": json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values}) | json_values,
    "ignore_eos": st.booleans() | json_values,
    "user": json_values,
    "logit_bias": json_values,
    "tools": json_values,
    "unknown_field": json_values,
}
chat_bodies = st.fixed_dictionaries(
    {"messages": messages | json_values},
    optional={
        **SAMPLING_FIELDS,
        "max_completion_tokens": st.integers(-5, 5) | json_values,
        "logprobs": st.booleans() | json_values,
        "top_logprobs": st.integers(-1, 25) | json_values,
    },
)
completion_bodies = st.fixed_dictionaries(
    {
        "prompt": st.text(max_size=60)
        | st.lists(st.integers(-5, 60000), min_size=0, max_size=8)
        | st.lists(st.text(max_size=20), max_size=4)
        | st.lists(st.lists(st.integers(-5, 60000), max_size=5), max_size=3)
        | json_values
    },
    optional={
        **SAMPLING_FIELDS,
        "logprobs": st.integers(-1, 25) | json_values,
        "echo": st.booleans() | json_values,
        "suffix": json_values,
        "best_of": json_values,
    },
)
ROUTES = {"chat": ("/v1/chat/completions", chat_bodies), "completions": ("/v1/completions", completion_bodies)}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_generated_bodies(route: str, http: httpx.Client) -> None:
    path, bodies = ROUTES[route]

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=bodies)
    def run(body: dict[str, Any]) -> None:
        body = tame(body)
        _count(f"hypothesis {route}")
        try:
            data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError):
            return
        check_response(http.post(path, content=data, headers={"content-type": "application/json"}), body)

    run()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_generated_raw_bytes(raw: bytes, http: httpx.Client) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        _count("hypothesis raw bytes")
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        check_response(r, raw)
        try:
            parsed = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            assert r.status_code == 400, (raw, r.text)
        else:
            assert r.status_code in (200, 400, 404), (parsed, r.text)


# ---- explicit cases ------------------------------------------------------------------------------
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}


def _cases() -> list[tuple[str, str, bytes, int, str | None]]:
    """(name, path, raw body, expected status, expected error param or code or None)."""

    def j(obj: Any) -> bytes:
        return json.dumps(obj).encode()

    chat, comp = "/v1/chat/completions", "/v1/completions"
    return [
        ("invalid json", chat, b'{"model": "x", "messages": [', 400, None),
        ("not an object", chat, b"[1, 2, 3]", 400, None),
        ("empty body", comp, b"", 400, None),
        ("json null", comp, b"null", 400, None),
        ("invalid utf-8", chat, b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}', 400, None),
        (
            "lone surrogate escape",
            chat,
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
            400,
            "messages",
        ),
        ("lone surrogate prompt", comp, b'{"prompt": "a\\udc00b", "max_tokens": 2}', 400, "prompt"),
        ("nul in content", chat, j({**CHAT, "messages": [{"role": "user", "content": "a\x00b"}]}), 200, None),
        ("deeply nested", chat, b'{"messages": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, None),
        ("huge integer literal", comp, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
        ("NaN temperature", comp, b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}', 400, "temperature"),
        ("Infinity top_p", comp, b'{"prompt": "x", "max_tokens": 2, "top_p": Infinity}', 400, "top_p"),
        ("messages wrong type", chat, j({**CHAT, "messages": "hello"}), 400, "messages"),
        ("max_tokens string", chat, j({**CHAT, "max_tokens": "many"}), 400, "max_tokens"),
        ("temperature list", chat, j({**CHAT, "temperature": [1]}), 400, "temperature"),
        ("stream string", comp, j({**COMPLETION, "stream": "yes please"}), 400, "stream"),
        ("prompt object", comp, j({**COMPLETION, "prompt": {"text": "hi"}}), 400, "prompt"),
        ("huge n", chat, j({**CHAT, "n": 10**9}), 400, "n"),
        ("zero n", chat, j({**CHAT, "n": 0}), 400, "n"),
        ("negative max_tokens", comp, j({**COMPLETION, "max_tokens": -1}), 400, "max_tokens"),
        ("zero max_tokens", comp, j({**COMPLETION, "max_tokens": 0}), 400, "max_tokens"),
        ("huge max_tokens", comp, j({**COMPLETION, "max_tokens": 10**15}), 400, "context_length_exceeded"),
        ("max_tokens beyond int64", comp, j({**COMPLETION, "max_tokens": 2**70}), 400, "context_length_exceeded"),
        ("max_tokens over the kv pool", comp, j({**COMPLETION, "max_tokens": 4000}), 400, None),
        (
            "negative max_completion_tokens",
            chat,
            j({**CHAT, "max_completion_tokens": -7}),
            400,
            "max_completion_tokens",
        ),
        ("prompt over the context", comp, j({**COMPLETION, "prompt": "hello " * 9000}), 400, "context_length_exceeded"),
        (
            "token prompt over the context",
            comp,
            j({**COMPLETION, "prompt": [42] * 9000}),
            400,
            "context_length_exceeded",
        ),
        (
            "chat over the context",
            chat,
            j({**CHAT, "messages": [{"role": "user", "content": "hi " * 9000}]}),
            400,
            "context_length_exceeded",
        ),
        ("token ids out of vocabulary", comp, j({**COMPLETION, "prompt": [1, 10**9]}), 400, "prompt"),
        ("negative token id", comp, j({**COMPLETION, "prompt": [-1]}), 400, "prompt"),
        ("empty token prompt", comp, j({**COMPLETION, "prompt": []}), 400, "prompt"),
        ("empty string prompt", comp, j({**COMPLETION, "prompt": ""}), 400, "prompt"),
        ("10k stop strings", chat, j({**CHAT, "stop": [f"s{i}" for i in range(10_000)]}), 400, "stop"),
        ("empty stop string", chat, j({**CHAT, "stop": [""]}), 400, "stop"),
        ("huge stop string", chat, j({**CHAT, "stop": "x" * 100_000}), 200, None),
        (
            "unknown fields",
            chat,
            j({**CHAT, "frobnicate": {"a": [1, 2]}, "user": "u1", "logit_bias": {"1": 5}}),
            200,
            None,
        ),
        ("empty messages", chat, j({**CHAT, "messages": []}), 400, "messages"),
        ("missing messages", chat, j({"model": MODEL}), 400, "messages"),
        ("wrong role", chat, j({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}), 400, "messages.0.role"),
        ("role missing", chat, j({**CHAT, "messages": [{"content": "hi"}]}), 400, "messages.0.role"),
        ("role not a string", chat, j({**CHAT, "messages": [{"role": 7, "content": "hi"}]}), 400, "messages.0.role"),
        (
            "image content part",
            chat,
            j({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            400,
            None,
        ),
        ("content a number", chat, j({**CHAT, "messages": [{"role": "user", "content": 5}]}), 400, None),
        ("unknown model", chat, j({**CHAT, "model": "gpt-7"}), 404, "model_not_found"),
        ("seed beyond int64", chat, j({**CHAT, "seed": 2**70}), 400, "seed"),
        ("top_logprobs without logprobs", chat, j({**CHAT, "top_logprobs": 3}), 400, None),
        ("top_logprobs too many", chat, j({**CHAT, "logprobs": True, "top_logprobs": 1000}), 400, "top_logprobs"),
        ("stream_options without stream", chat, j({**CHAT, "stream_options": {"include_usage": True}}), 400, None),
        ("echo with logprobs", comp, j({**COMPLETION, "echo": True, "logprobs": 1}), 200, None),
        ("echo alone, max_tokens 0", comp, j({**COMPLETION, "echo": True, "max_tokens": 0}), 200, None),
        ("too many prompts", comp, j({**COMPLETION, "prompt": ["a"] * 1000}), 400, "prompt"),
        ("n with stream", chat, j({**CHAT, "n": 3, "stream": True}), 200, None),
        ("temperature 0 top_p 0", chat, j({**CHAT, "temperature": 0, "top_p": 0}), 200, None),
    ]


@pytest.mark.parametrize("name,path,raw,status,detail", _cases(), ids=[c[0] for c in _cases()])
def test_explicit_bad_input(
    name: str, path: str, raw: bytes, status: int, detail: str | None, http: httpx.Client
) -> None:
    _count("explicit")
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    check_response(r, name)
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    if status >= 400:
        err = r.json()["error"]
        if detail is not None:
            assert detail in (err.get("param"), err.get("code")), (name, err)
    elif r.headers["content-type"].startswith("application/json"):
        assert r.json()["choices"], r.text


def test_wrong_content_type_and_methods(http: httpx.Client) -> None:
    for headers, content in (({"content-type": "text/plain"}, json.dumps(CHAT)), ({}, b"messages=hi")):
        _count("explicit")
        r = http.post("/v1/chat/completions", content=content, headers=headers)
        check_response(r)
    for method, path in (("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"), ("PUT", "/v1/completions")):
        _count("explicit")
        r = http.request(method, path)
        check_response(r)
        assert r.status_code == 405
    _count("explicit")
    r = http.get("/v1/no/such/route")
    check_response(r)
    assert r.status_code == 404


def test_enormous_body_is_413(cluster: LocalCluster, http: httpx.Client) -> None:
    """Over the router's 8 MiB limit: 413, whether the size is declared or the body is streamed chunked,
    without the router reading (or parsing) the whole thing."""
    big = json.dumps({**COMPLETION, "prompt": "x" * (9 * 1024 * 1024)}).encode()
    _count("explicit")
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    check_response(r)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    _count("explicit")
    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    check_response(r)
    assert r.status_code == 413
    # A declared length that is a lie (huge) is refused up front, before any body byte.
    u = urlsplit(cluster.router_url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000000\r\n\r\n{"
        )
        head = s.recv(4096).decode(errors="replace")
    _count("explicit")
    assert head.startswith("HTTP/1.1 413"), head
    # The router is fine afterwards.
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


# ---- the workers' internal endpoints -------------------------------------------------------------
def _worker_posts(cluster: LocalCluster) -> list[str]:
    p, d = cluster.prefill_urls[0], cluster.decode_urls[0]
    return [
        f"{p}/internal/handshake",
        f"{p}/internal/prefill",
        f"{p}/internal/abort",
        f"{d}/internal/generate",
        f"{d}/internal/abort",
    ]


MALFORMED: list[tuple[str, bytes]] = [
    ("invalid json", b"{not json"),
    ("empty", b""),
    ("invalid utf-8", b'{"req_id": "\xff\xfe"}'),
    ("array", b"[1, 2]"),
    ("string", b'"hello"'),
    ("null", b"null"),
    ("deeply nested", b"[" * 100000 + b"]" * 100000),
    ("huge integer", b'{"protocol_version": ' + b"9" * 5000 + b"}"),
    ("NaN", b'{"protocol_version": NaN}'),
    ("unknown version", b'{"protocol_version": 99, "req_id": "x"}'),
    ("version as text", b'{"protocol_version": "one", "req_id": "x"}'),
    ("unknown field", b'{"req_id": "x", "surprise": 1}'),
]


@pytest.mark.parametrize("name,raw", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_internal_endpoints_reject_malformed_messages(name: str, raw: bytes, cluster: LocalCluster) -> None:
    for url in _worker_posts(cluster):
        _count("internal explicit")
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400, (url, name, r.status_code, r.text[:300])
        err = assert_openai_error(r.json())
        if name == "unknown version":
            assert "protocol_version" in err["message"], err


def test_internal_messages_with_bad_values(cluster: LocalCluster) -> None:
    d, p = cluster.decode_urls[0], cluster.prefill_urls[0]

    def gen(**kw: Any) -> httpx.Response:
        _count("internal explicit")
        body = {"req_id": uuid.uuid4().hex, "token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}, **kw}
        return httpx.post(f"{d}/internal/generate", json=body, timeout=30)

    bad = [
        gen(token_ids=[]),
        gen(token_ids=[-1]),
        gen(token_ids=[10**9]),
        gen(token_ids=[2**70]),
        gen(token_ids="abc"),
        gen(req_id=""),
        gen(req_id="x" * 1000),
        gen(sampling={"max_tokens": 0}),
        gen(sampling={"max_tokens": 10**12}),  # beyond the context
        gen(sampling={"max_tokens": 4000}),  # fits the context, not the pool
        gen(sampling={"seed": 2**70}),  # used to kill the decode engine process
        gen(sampling={"seed": -(2**70)}),
        gen(sampling={"temperature": -1}),
        gen(sampling={"top_logprobs": 10**6}),
        gen(sampling={"stop_token_ids": list(range(5000))}),
        gen(sampling={"unknown": 1}),
        gen(prefill_url=12),
    ]
    for r in bad:
        assert r.status_code == 400, r.text
        assert_openai_error(r.json())
    # Edge values that are valid are served (they reach the sampler: nothing overflows in the engine).
    for sampling in (
        {"seed": 2**63 - 1, "temperature": 1},
        {"seed": -(2**63), "temperature": 1},
        {"top_k": 10**12},
        {"stop_token_ids": [2**70]},
    ):
        r = gen(sampling={"max_tokens": 2, **sampling})
        assert r.status_code == 200, (sampling, r.text)
        assert json.loads(r.text.splitlines()[-1])["finish_reason"] in ("length", "stop"), r.text
    # A prefill job naming a peer that never handshook.
    _count("internal explicit")
    body = {
        "req_id": "p1",
        "token_ids": [1, 2],
        "sampling": {},
        "dst_agent": "nobody",
        "dst_instance_id": "x",
        "dst_pages": [0],
    }
    r = httpx.post(f"{p}/internal/prefill", json=body, timeout=10)
    assert r.status_code == 409 and assert_openai_error(r.json())["code"] == "unknown_peer"
    for url in (d, p):
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_internal_handshake_and_prefill_with_a_real_nixl_peer(cluster: LocalCluster) -> None:
    """This process becomes a decode-side NIXL agent (a tiny KV pool of its own), so the prefill worker's
    checks after the handshake are reachable: garbage metadata, then page ids outside our pool. None may
    take the engine down; a well-formed job still works (its KV lands in our pool over NIXL)."""
    import base64

    import torch

    from common.kv.pool import KVLayout, KVPool
    from common.transfer.agent import KVTransferAgent

    p = cluster.prefill_urls[0]
    layout = prefill_layout(p)
    dtype = getattr(torch, layout["dtype"])
    pool = KVPool(
        KVLayout(layout["num_layers"], layout["num_kv_heads"], layout["head_dim"], layout["page_size"], dtype), 4
    )
    agent = KVTransferAgent(f"fuzz-{uuid.uuid4().hex[:8]}", pool, model_id=layout["model_id"])
    good = {
        "agent_name": agent.name,
        "instance_id": agent.instance_id,
        "agent_metadata_b64": agent.metadata_b64(),
        "pool_info_b64": agent.pool_info_b64(),
        "layout": layout,
    }
    garbage = [
        {**good, "agent_metadata_b64": "!!not base64!!"},
        {**good, "pool_info_b64": "!!"},
        {**good, "pool_info_b64": base64.b64encode(b'{"version": 2}').decode()},
        {**good, "pool_info_b64": base64.b64encode(b'[{"version": 2}]').decode()},
        {**good, "pool_info_b64": base64.b64encode(b"[]").decode()},
        {**good, "agent_metadata_b64": base64.b64encode(b"not nixl metadata" * 8).decode()},
        {**good, "instance_id": "someone-else"},  # pool info says otherwise
        {**good, "layout": {**layout, "page_size": layout["page_size"] * 2}},
    ]
    for hs in garbage:
        _count("internal explicit")
        r = httpx.post(f"{p}/internal/handshake", json=hs, timeout=10)
        assert r.status_code == 400, (hs, r.status_code, r.text)
        assert_openai_error(r.json())
    _count("internal explicit")
    r = httpx.post(f"{p}/internal/handshake", json=good, timeout=10)
    assert r.status_code == 200, r.text
    ids = list(range(100, 100 + 2 * layout["page_size"]))  # two pages of prompt

    def prefill(pages: list[Any]) -> httpx.Response:
        _count("internal explicit")
        return httpx.post(f"{p}/internal/prefill", json=prefill_request(agent, ids, pages, 20), timeout=30)

    for pages in ([10**6, 10**6 + 1], [-1, 0], [0], [0, 1, 2], [2**70, 0], ["a", "b"]):
        r = prefill(pages)
        assert r.status_code == 400, (pages, r.status_code, r.text)
        assert_openai_error(r.json())
    assert httpx.get(f"{p}/health", timeout=5).status_code == 200
    r = prefill([1, 2])
    assert r.status_code == 200, r.text
    last = json.loads(r.text.splitlines()[-1])
    assert last.get("done") is True, r.text
    assert pool.kv[1:3].abs().sum() > 0 and pool.kv[0].abs().sum() == 0  # the KV landed where we asked
    agent.close()
    wait_pages_back(p)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    body=st.dictionaries(
        st.sampled_from(
            ["protocol_version", "req_id", "token_ids", "sampling", "prefill_url", "agent_name", "dst_pages", "x"]
        ),
        json_values,
        max_size=5,
    )
)
def test_generated_internal_messages(body: dict[str, Any], cluster: LocalCluster) -> None:
    data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    for url in _worker_posts(cluster):
        _count("hypothesis internal")
        r = httpx.post(url, content=data, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code < 500, (url, body, r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert_openai_error(r.json())
