"""The HTTP limits (common/settings.py HttpLimits) on real uvicorn servers, probed with raw sockets: the router's
app (no workers needed: every refusal here comes before routing) and a prefill worker's control plane.

The deadlines are set small here (through the same settings a deployment uses); each check allows many times
the setting, so only a connection that is never closed fails it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from common.config import RouterConfig, WorkerConfig
from common.http_server import server_options
from common.net import free_port
from common.settings import HttpLimits
from router.decision.discovery import StaticDiscovery
from router.server_thread import ServerThread
from router.settings import RouterOptions
from router.surface.tokenizer import ModelInfo, RouterTokenizer
from tests.helpers import wait_until

LIMITS = HttpLimits(
    max_body_bytes=1024 * 1024,  # above the largest JSON schema allowed (router/surface/structured.py)
    max_internal_body_bytes=512 * 1024,
    header_timeout_s=0.5,
    body_timeout_s=0.5,
    keep_alive_s=0.5,
    write_timeout_s=0.5,
)
CLOSED_WITHIN_S = 10.0  # far above every deadline in LIMITS
CHAT = "/v1/chat/completions"


def router_app(smol_path, limits: HttpLimits = LIMITS):
    """The real router app with no workers behind it (the limits are the router's own)."""
    from router.app import create_app

    return create_app(
        RouterConfig(api_key=None),
        RouterOptions(),
        tokenizer=RouterTokenizer.from_dir(smol_path),
        model_info=ModelInfo.from_dir("smollm2-135m-instruct", smol_path),
        discovery=StaticDiscovery([], []),
        use_redis=False,
        http_limits=limits,
    )


@contextmanager
def router_server(smol_path, http: str) -> Iterator[tuple[str, int]]:
    with ServerThread(router_app(smol_path), limits=LIMITS, http=http) as server:
        yield "127.0.0.1", server.port


@contextmanager
def worker_server() -> Iterator[tuple[str, int]]:
    """A prefill worker's control plane as serve_worker runs it (its engine is not started: lifespan off)."""
    from common.worker.control import create_app

    app = create_app("prefill", WorkerConfig.from_env("prefill"), http_limits=LIMITS)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", **server_options(LIMITS))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "worker server did not start"
        time.sleep(0.01)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module", params=["httptools", "h11"])
def router_addr(smol_path, request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    """The router's app under each HTTP parser the router may run (``KVFERRY_ROUTER_HTTP``)."""
    with router_server(smol_path, request.param) as addr:
        yield addr


@dataclass
class Server:
    addr: tuple[str, int]
    post_path: str  # a POST route that reads a body
    get_path: str  # a GET route past the front (a worker answers its probes before any limit but the protocol's)
    max_body_bytes: int


@pytest.fixture(scope="module", params=["router-httptools", "router-h11", "worker"])
def server(smol_path, request: pytest.FixtureRequest) -> Iterator[Server]:
    """The router (each parser) and a worker's control plane."""
    if request.param == "worker":
        with worker_server() as addr:
            yield Server(addr, "/internal/prefill", "/metrics", LIMITS.max_internal_body_bytes)
    else:
        with router_server(smol_path, request.param.removeprefix("router-")) as addr:
            yield Server(addr, CHAT, "/health", LIMITS.max_body_bytes)


# ---- raw HTTP/1.1 ---------------------------------------------------------------------------------
def connect(addr: tuple[str, int]) -> socket.socket:
    return socket.create_connection(addr, timeout=CLOSED_WITHIN_S)


def read_until_closed(s: socket.socket, timeout_s: float = CLOSED_WITHIN_S) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or ``timeout_s`` passes (False)."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, False
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (Content-Length framed) from ``s``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed inside a response body"
        body += chunk
    return status, headers, body


def read_statuses(s: socket.socket, count: int) -> list[int]:
    """The statuses of ``count`` responses (Content-Length framed) arriving back to back on ``s``."""
    data = b""
    statuses: list[int] = []
    while len(statuses) < count:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            head = data[:head_end].decode("latin-1")
            length = int(
                next(
                    (v for k, _, v in (h.partition(":") for h in head.split("\r\n")) if k.lower() == "content-length"),
                    "0",
                )
            )
            if len(data) >= head_end + 4 + length:
                statuses.append(int(head.split()[1]))
                data = data[head_end + 4 + length :]
                continue
        chunk = s.recv(65536)
        assert chunk, f"closed after {statuses}"
        data += chunk
    return statuses


def status_of(raw: bytes) -> int:
    assert raw.startswith(b"HTTP/1.1 "), raw[:200]
    return int(raw.split(b" ", 2)[1])


def error_of(raw: bytes) -> dict:
    return json.loads(raw.partition(b"\r\n\r\n")[2])["error"]


def request(addr: tuple[str, int], raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with connect(addr) as s:
        s.sendall(raw)
        return read_response(s)


def get(path: str = "/health", headers: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"


def post(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def stream_until_answered(s: socket.socket, first: bytes, filler: bytes, most: int) -> tuple[bytes, int]:
    """Sends ``first`` then ``filler`` again and again (up to ``most`` bytes) until the server answers;
    returns what it sent back (up to its close) and how many bytes were sent."""
    s.sendall(first)
    sent = len(first)
    while sent < most:
        readable, _, _ = select.select([s], [], [], 0.01)
        if readable:
            break
        try:
            s.sendall(filler)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += len(filler)
    raw, closed = read_until_closed(s)
    assert closed, "the refused connection was not closed"
    return raw, sent


# ---- header size and count: 431 ------------------------------------------------------------------
def test_endless_header_is_431_at_the_limit_and_others_are_served(server: Server) -> None:
    """A header that never ends (the probe sent 128 MB) is refused once the head passes the limits, not after
    whatever the client sends; a normal request on another connection is answered meanwhile."""
    addr = server.addr
    with connect(addr) as s:
        first = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
        raw, sent = stream_until_answered(s, first, b"a" * 65536, most=128 * 1024 * 1024)
        assert status_of(raw) == 431
        assert error_of(raw)["code"] == "request_header_fields_too_large"
        assert str(LIMITS.max_header_bytes) in error_of(raw)["message"]
        cap = LIMITS.max_url_bytes + LIMITS.max_header_bytes
        assert sent < cap + 16 * 65536, sent  # refused near the cap, not after the 128 MB
        status, _, _ = request(addr, get())  # another connection, served as usual
        assert status == 200


def test_big_header_does_not_stall_a_concurrent_request(router_addr) -> None:
    """While a client pushes an endless header as fast as it can, requests on other connections go on."""
    stop = threading.Event()
    outcomes: list[int] = []

    def push() -> None:
        while not stop.is_set():
            with connect(router_addr) as s:
                try:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (4 * 1024 * 1024))
                except (BrokenPipeError, ConnectionResetError):
                    pass
                raw, _ = read_until_closed(s)
                if raw:
                    outcomes.append(status_of(raw))

    pusher = threading.Thread(target=push, daemon=True)
    pusher.start()
    try:
        for _ in range(20):
            status, _, body = request(router_addr, get())
            assert status == 200, body
    finally:
        stop.set()
        pusher.join(CLOSED_WITHIN_S)
    assert set(outcomes) <= {431}, outcomes


def test_too_many_headers_is_431(server: Server) -> None:
    addr = server.addr
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(LIMITS.max_header_count + 1))
    status, _, body = request(addr, get(server.get_path, headers=many))
    assert status == 431
    error = json.loads(body)["error"]
    assert error["code"] == "request_header_fields_too_large"
    assert str(LIMITS.max_header_count) in error["message"]
    # At the limit: served.
    fine = b"".join(b"X-H%d: v\r\n" % i for i in range(LIMITS.max_header_count - 1))
    assert request(addr, get(server.get_path, headers=fine))[0] == 200


def test_headers_just_over_the_size_limit_are_431(router_addr) -> None:
    """Headers a little over max_header_bytes in all (each line well under it): the exact check."""
    line = b"X-Pad: " + b"p" * 8000 + b"\r\n"
    over = line * (LIMITS.max_header_bytes // len(line) + 1)
    status, _, body = request(router_addr, get(headers=over))
    assert status == 431, body
    assert str(LIMITS.max_header_bytes) in json.loads(body)["error"]["message"]
    under = line * (LIMITS.max_header_bytes // len(line) - 1)
    assert request(router_addr, get(headers=under))[0] == 200


# ---- URL: 414 -------------------------------------------------------------------------------------
def test_long_url_is_414(server: Server) -> None:
    addr = server.addr
    status, _, body = request(addr, get(server.get_path + "?q=" + "x" * LIMITS.max_url_bytes))
    assert status == 414
    error = json.loads(body)["error"]
    assert error["code"] == "url_too_long" and str(LIMITS.max_url_bytes) in error["message"]
    assert request(addr, get(server.get_path + "?q=" + "x" * (LIMITS.max_url_bytes - 100)))[0] == 200


def test_url_past_the_parsers_own_limit_is_414_json(server: Server) -> None:
    """A request line of 64 KiB and more arriving at once (httptools refuses those itself, in plain text) gets
    the same JSON 414 as one just over the limit."""
    for size in (64 * 1024, 256 * 1024):
        with connect(server.addr) as s:
            s.sendall(get(server.get_path + "?q=" + "x" * size))
            raw, closed = read_until_closed(s)
        assert closed and status_of(raw) == 414, raw[:200]
        assert error_of(raw)["code"] == "url_too_long"


def test_endless_request_line_is_414_at_the_limit(router_addr) -> None:
    with connect(router_addr) as s:
        raw, sent = stream_until_answered(s, b"GET /", b"x" * 4096, most=64 * 1024 * 1024)
    assert status_of(raw) == 414 and error_of(raw)["code"] == "url_too_long"
    assert sent < LIMITS.max_url_bytes + 64 * 4096, sent


def test_heads_refused_before_parsing_are_counted_by_status(router_addr) -> None:
    """A head refused while it arrives (too big, too slow) never reaches the app, and is counted in
    ``kvferry_router_http_requests_total`` all the same, by its status."""

    def refused(status: int) -> float:
        _, _, text = request(router_addr, get("/metrics"))
        line = f'kvferry_router_http_requests_total{{method="unparsed",route="unparsed",status="{status}"}} '
        return sum(float(x.removeprefix(line)) for x in text.decode().splitlines() if x.startswith(line))

    before = {status: refused(status) for status in (408, 414, 431)}
    with connect(router_addr) as s:
        raw, _ = stream_until_answered(s, b"GET /health HTTP/1.1\r\nX-Big: ", b"a" * 65536, most=8 * 1024 * 1024)
        assert status_of(raw) == 431
    with connect(router_addr) as s:
        raw, _ = stream_until_answered(s, b"GET /", b"x" * 4096, most=8 * 1024 * 1024)
        assert status_of(raw) == 414
    with connect(router_addr) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost")  # and nothing more: cut at the header deadline
        raw, _ = read_until_closed(s)
        assert status_of(raw) == 408
    assert {status: refused(status) - before[status] for status in before} == {408: 1, 414: 1, 431: 1}


# ---- deadlines: 408 or a close --------------------------------------------------------------------
def test_partial_request_lines_are_closed_after_the_header_deadline(server: Server) -> None:
    """Many sockets each holding a partial request line (slowloris): each gets 408 and is closed."""
    addr = server.addr
    socks = [connect(addr) for _ in range(50)]
    try:
        for s in socks:
            s.sendall(b"GET /hea")
        for s in socks:
            raw, closed = read_until_closed(s)
            assert closed, "a partial request line was held open"
            assert status_of(raw) == 408 and error_of(raw)["code"] == "request_timeout"
        assert request(addr, get())[0] == 200
    finally:
        for s in socks:
            s.close()


def trickle(s: socket.socket, piece: bytes) -> None:
    """Keeps sending `piece` until the server answers or closes (or CLOSED_WITHIN_S passes)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < CLOSED_WITHIN_S:
        readable, _, _ = select.select([s], [], [], 0.05)
        if readable:
            return
        try:
            s.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            return


def test_headers_trickled_slowly_are_cut_at_the_deadline(router_addr) -> None:
    """A head that keeps coming, a byte at a time, never completes: the deadline counts from its start."""
    with connect(router_addr) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        trickle(s, b"X")
        raw, closed = read_until_closed(s)
    assert closed and status_of(raw) == 408


def test_silent_connection_is_closed(router_addr) -> None:
    with connect(router_addr) as s:
        raw, closed = read_until_closed(s)
    assert closed and raw == b""  # nothing asked, nothing answered


def test_pipelined_and_keep_alive_requests_are_served(router_addr) -> None:
    """The limits count per request: requests sent back to back on one connection (pipelined, then one more
    after a pause under the deadlines) are each answered."""
    with connect(router_addr) as s:
        s.sendall(get() * 3 + post(CHAT, b"{}"))
        statuses = read_statuses(s, 4)
        assert statuses == [200, 200, 200, 400]
        time.sleep(LIMITS.keep_alive_s / 5)
        s.sendall(get())
        assert read_response(s)[0] == 200


def test_a_body_read_after_its_head_is_not_taken_for_a_head(router_addr) -> None:
    """A reused connection: a request refused (413) before its body is read, the next one right behind it, so
    that one read holds the end of the first and the head of the second, and later reads the second's body
    (longer than any request line may be). Both are answered; the body is not taken for a head."""
    oversized = b"x" * (LIMITS.max_body_bytes + 1)
    body = b'{"model": "' + b"a" * (600 * 1024) + b'"}'
    with connect(router_addr) as s:
        s.sendall(post(CHAT, oversized) + post(CHAT, body))
        statuses = read_statuses(s, 2)
    assert statuses[0] == 413 and 400 <= statuses[1] < 500, statuses


def test_idle_keep_alive_connection_is_closed(router_addr) -> None:
    with connect(router_addr) as s:
        s.sendall(get())
        status, headers, _ = read_response(s)
        assert status == 200 and headers.get("connection") != "close"
        raw, closed = read_until_closed(s)
    assert closed and raw == b""


def test_never_ending_chunked_body_is_408(server: Server) -> None:
    """A chunked body that keeps coming in small chunks and never ends."""
    addr = server.addr
    path = server.post_path
    with connect(addr) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        trickle(s, b"1\r\n \r\n")
        raw, closed = read_until_closed(s)
    assert closed and status_of(raw) == 408
    assert error_of(raw)["code"] == "request_timeout"


def test_body_that_stops_coming_is_408(router_addr) -> None:
    with connect(router_addr) as s:
        s.sendall(post(CHAT, b"{" + b" " * 100)[:-50])  # Content-Length promises 50 bytes more
        raw, closed = read_until_closed(s)
    assert closed and status_of(raw) == 408


# ---- body: 413 ------------------------------------------------------------------------------------
def test_oversized_body_is_413(server: Server) -> None:
    addr = server.addr
    path = server.post_path
    big = b'{"x": "' + b"a" * server.max_body_bytes + b'"}'
    status, _, body = request(addr, post(path, big))
    assert status == 413
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and str(server.max_body_bytes) in error["message"]
    # Streamed (chunked, no Content-Length): cut as soon as it passes the limit.
    with connect(addr) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        piece = b"a" * 16384
        for _ in range(server.max_body_bytes // len(piece) + 2):
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        status, _, body = read_response(s)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


# ---- JSON schemas: 400 naming the limit ------------------------------------------------------------
def nested_object_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def deep_schema_requests(schema: dict) -> dict[str, dict]:
    msgs = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return {
        "response_format": {
            "messages": msgs,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        },
        "guided_json": {"messages": msgs, "guided_json": schema},
        "guided_json as text": {"messages": msgs, "guided_json": json.dumps(schema)},
        "tools": {"messages": msgs, "tools": [tool]},
    }


@pytest.mark.parametrize("levels", [33, 95, 300])
def test_deep_json_schema_is_400_naming_the_limit(router_addr, levels: int) -> None:
    from router.surface.structured import MAX_SCHEMA_DEPTH

    for where, body in deep_schema_requests(nested_object_schema(levels)).items():
        status, _, raw = request(router_addr, post(CHAT, json.dumps(body).encode()))
        assert status == 400, (where, raw[:300])
        message = json.loads(raw)["error"]["message"]
        assert f"nests JSON objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels" in message, (where, message)


def test_large_json_schema_is_400_naming_the_limit(router_addr) -> None:
    from router.surface.structured import MAX_SCHEMA_BYTES

    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_BYTES // 16)}}
    for where, body in deep_schema_requests(wide).items():
        status, _, raw = request(router_addr, post(CHAT, json.dumps(body).encode()))
        assert status == 400, (where, raw[:300])
        assert f"larger than {MAX_SCHEMA_BYTES} bytes" in json.loads(raw)["error"]["message"], where


def big_grammar_requests() -> dict[str, tuple[dict, str]]:
    """Requests whose output constraint is past one of the bounds on what a grammar may hold, each with the
    setting its 400 must name."""
    from router.surface.structured import LIMITS

    msgs = [{"role": "user", "content": "hi"}]
    enum = {"type": "string", "enum": [f"v{i}" for i in range(20_000)]}  # 20,000 strings: compiled 15 s
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    long_enum = {"type": "string", "enum": ["x" * 200] * (LIMITS.schema_max_enum_chars // 200 + 1)}
    hidden = {"type": "object", "properties": {"enum": enum}}  # a property named "enum" holds a schema too
    out: dict[str, tuple[dict, str]] = {}
    for name, schema, setting in (
        ("enum values", enum, "KVFERRY_ROUTER_SCHEMA_MAX_ENUM_VALUES"),
        ("properties", wide, "KVFERRY_ROUTER_SCHEMA_MAX_PROPERTIES"),
        ("enum characters", long_enum, "KVFERRY_ROUTER_SCHEMA_MAX_ENUM_CHARS"),
        ("nested enum", hidden, "KVFERRY_ROUTER_SCHEMA_MAX_ENUM_VALUES"),
    ):
        for where, body in deep_schema_requests(schema).items():
            out[f"{name} in {where}"] = (body, setting)
    big = LIMITS.grammar_max_bytes + 1
    out["guided_regex"] = ({"messages": msgs, "guided_regex": "a" * big}, "KVFERRY_ROUTER_GRAMMAR_MAX_BYTES")
    ebnf = 'root ::= "' + "a" * big + '"'
    out["guided_grammar"] = ({"messages": msgs, "guided_grammar": ebnf}, "KVFERRY_ROUTER_GRAMMAR_MAX_BYTES")
    choices = ["c" * 100 + str(i) for i in range(200)]
    out["guided_choice"] = ({"messages": msgs, "guided_choice": choices}, "KVFERRY_ROUTER_SCHEMA_MAX_ENUM_CHARS")
    return out


def test_grammar_past_its_bounds_is_400_naming_the_limit(router_addr) -> None:
    """Checked at the router before any work: a worker never compiles such a grammar (no worker here at all)."""
    for where, (body, setting) in big_grammar_requests().items():
        status, _, raw = request(router_addr, post(CHAT, json.dumps(body).encode()))
        assert status == 400, (where, raw[:300])
        message = json.loads(raw)["error"]["message"]
        assert setting in message and "(the limit" in message, (where, message)


def test_ordinary_schema_within_the_bounds_passes_validation(router_addr) -> None:
    """OpenAI-sized schemas pass: every bound at once, just within it (the router, with no worker, answers 503)."""
    from router.surface.structured import LIMITS

    per = LIMITS.schema_max_enum_chars // LIMITS.schema_max_enum_values
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string"} for i in range(LIMITS.schema_max_properties - 1)}
        | {"kind": {"type": "string", "enum": ["x" * per] * LIMITS.schema_max_enum_values}},
        "required": ["kind"],
    }
    for where, body in deep_schema_requests(schema).items():
        if where == "tools":
            continue  # a tool's schema is also in the prompt: this one is longer than the context
        status, _, raw = request(router_addr, post(CHAT, json.dumps(body).encode()))
        assert status == 503, (where, raw[:300])


def test_schema_within_the_limits_passes_validation(router_addr) -> None:
    """Deep (but under the limit) schemas get past validation: the router, with no worker, answers 503."""
    for where, body in deep_schema_requests(nested_object_schema(20)).items():
        status, _, raw = request(router_addr, post(CHAT, json.dumps(body).encode()))
        assert status == 503, (where, raw[:300])


# ---- prompts: bounded before tokenizing ------------------------------------------------------------
PROSE = "The harbour pilot climbs aboard at dawn, reads the tide tables and names the berth. "


def prompt_bodies(text: str) -> dict[str, dict]:
    return {
        CHAT: {"messages": [{"role": "user", "content": text}]},
        "/tokenize": {"prompt": text},
        "/v1/completions": {"prompt": text, "max_tokens": 4},
        "/v1/responses": {"input": text},
    }


def test_prompt_past_the_context_is_refused_without_tokenizing_it_all(router_addr, smol_path) -> None:
    """Every route taking a prompt refuses one past the model's context with the context error, from a bound:
    a prompt whose bytes prove it too long names that bound (its full count would be ~200 k tokens), one whose
    bytes do not is refused once counting passes the context (its full count would be ~20 k)."""
    tok = RouterTokenizer.from_dir(smol_path)
    context = ModelInfo.from_dir("m", smol_path).max_context
    huge = PROSE * (LIMITS.max_body_bytes // len(PROSE) - 100)
    by_bytes = -(-len(huge.encode()) // tok.max_token_bytes)
    medium = PROSE * 1000
    assert by_bytes > context > len(medium.encode()) // tok.max_token_bytes
    for text, at_least in ((huge, by_bytes), (medium, context + 1)):
        for path, body in prompt_bodies(text).items():
            status, _, raw = request(router_addr, post(path, json.dumps(body).encode()))
            assert status == 400, (path, raw[:300])
            error = json.loads(raw)["error"]
            assert error["code"] == "context_length_exceeded", (path, error)
            named = int(error["message"].split("at least ")[1].split(" tokens")[0])
            assert at_least <= named <= at_least + 8, (path, error["message"])  # (+ a chat template's own bytes)
    status, _, raw = request(router_addr, post("/tokenize", json.dumps({"prompt": PROSE * 100}).encode()))
    assert status == 200 and json.loads(raw)["count"] == len(tok.encode(PROSE * 100))


def test_big_prompts_leave_the_router_process_at_its_idle_memory() -> None:
    """Twenty prompts of 7 MiB (under the default 8 MiB body cap) each answered 400 by a router process, whose
    memory then is back within 50 MB of what it was idle (full tokenization took it from ~120 MB to ~1.4 GB)."""
    from tests.workers import start_router_process

    router = start_router_process()
    try:
        text = PROSE * (7 * 1024 * 1024 // len(PROSE))
        bodies = [(path, json.dumps(body).encode()) for path, body in prompt_bodies(text).items()]
        with httpx.Client(base_url=router.url, timeout=60) as client:
            client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})  # template loaded
            idle = router.rss_mb()
            for i in range(20):
                path, body = bodies[i % len(bodies)]
                r = client.post(path, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        deadline = time.monotonic() + CLOSED_WITHIN_S
        while router.rss_mb() > idle + 50:
            assert time.monotonic() < deadline, f"router RSS {router.rss_mb():.0f} MB, idle {idle:.0f} MB"
            time.sleep(0.1)
    finally:
        router.stop()


# ---- 500s: a traceback at most once a minute ------------------------------------------------------
class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_500_logs_its_traceback_once_and_a_line_each_time(smol_path) -> None:
    """Every request hitting the same failure gets its 500 and a log line; the traceback (thousands of lines
    for a deep recursion) is written once, not per request."""
    app = router_app(smol_path)

    def recurse(n: int) -> int:
        return recurse(n + 1) + 1

    async def failing() -> None:
        recurse(0)

    app.add_api_route("/v1/fails", failing, methods=["GET"])
    handler = Records()
    loggers = [logging.getLogger("kvferry.router"), logging.getLogger("uvicorn.error")]
    with ServerThread(app, limits=LIMITS) as server:  # (uvicorn sets up its loggers as it starts)
        for logger in loggers:
            logger.addHandler(handler)
        try:
            for _ in range(20):
                status, _, body = request(("127.0.0.1", server.port), get("/v1/fails"))
                assert status == 500 and json.loads(body)["error"]["code"] == "internal_error"
            # uvicorn logs the exception after the 500 is sent: wait for its last line.
            deadline = time.monotonic() + CLOSED_WITHIN_S
            while len([r for r in handler.records if r.name == "uvicorn.error"]) < 20 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            for logger in loggers:
                logger.removeHandler(handler)
    failures = [r for r in handler.records if r.name == "kvferry.router"]
    assert len(failures) == 20  # a line per request
    assert len([r for r in handler.records if r.name == "uvicorn.error"]) == 20  # uvicorn's own, too
    with_traceback = [r for r in handler.records if r.exc_info]
    assert len(with_traceback) <= 2, [r.getMessage() for r in with_traceback]  # one per logger at most
    assert all("RecursionError" in r.getMessage() for r in failures if not r.exc_info)


def test_traceback_limiter_keeps_the_first_and_counts_the_rest() -> None:
    from common.log import TracebackLimiter

    def record() -> logging.LogRecord:
        try:
            raise ValueError("bad 100%")
        except ValueError:
            return logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())

    limiter = TracebackLimiter(interval_s=3600.0)
    records = [record() for _ in range(5)]
    assert all(limiter.filter(r) for r in records)
    assert records[0].exc_info and not any(r.exc_info for r in records[1:])
    assert records[4].getMessage() == (
        "failed here [ValueError: bad 100% (traceback logged at most once a minute; 4 since)]"
    )
    fresh = TracebackLimiter(interval_s=0.0)  # a minute has passed each time
    again = [record() for _ in range(3)]
    assert all(fresh.filter(r) and r.exc_info for r in again)


def test_repeated_warnings_are_kept_once_a_minute_and_counted() -> None:
    from common.log import RepeatLimiter

    def record(msg: str, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", level, __file__, 1, msg, None, None)

    limiter = RepeatLimiter(interval_s=3600.0)
    kept = [limiter.filter(record("Invalid HTTP request received.")) for _ in range(50)]
    assert kept.count(True) == 1 and kept[0]
    assert limiter.filter(record("Unsupported upgrade request."))  # another message: its own count
    assert all(limiter.filter(record("boom", logging.ERROR)) for _ in range(3))  # errors are each kept
    counted = RepeatLimiter(interval_s=0.0)
    assert counted.filter(record("x"))
    counted._last[("uvicorn.error", "x")] = (counted._last[("uvicorn.error", "x")][0], 7)  # 7 dropped meanwhile
    r = record("x")
    assert counted.filter(r) and r.getMessage() == "x (7 more in the last minute, not logged)"


def test_garbage_requests_do_not_log_a_line_each(router_addr) -> None:
    handler = Records()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        for _ in range(30):
            with connect(router_addr) as s:
                s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
                raw, closed = read_until_closed(s)
                assert closed and status_of(raw) == 400
    finally:
        logger.removeHandler(handler)
    assert len(handler.records) <= 1, [r.getMessage() for r in handler.records]


def test_unparseable_requests_get_a_json_400(server: Server) -> None:
    """Bytes the parser cannot read as HTTP/1.1 (not HTTP at all, a bad header line, a broken chunk) are
    answered in OpenAI's error shape, not uvicorn's plain text, and closed."""
    head = f"POST {server.post_path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    for raw_request in (
        b"\x16\x03\x01 not http at all\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        head + b"zz\r\nnot a chunk size\r\n",
    ):
        with connect(server.addr) as s:
            s.sendall(raw_request)
            raw, closed = read_until_closed(s)
        assert closed and status_of(raw) == 400, (raw_request, raw[:200])
        assert b"content-type: application/json" in raw.lower()
        error = error_of(raw)
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http_request", error


@pytest.mark.parametrize(
    ("coding", "status", "code"),
    [
        ("gzip, chunked", 501, "unsupported_transfer_encoding"),  # RFC 9112 6.1: a coding not implemented
        ("deflate,chunked", 501, "unsupported_transfer_encoding"),
        ("gzip", 400, "invalid_transfer_encoding"),  # RFC 9112 6.3: chunked not final, length unknown
        ("chunked, gzip", 400, "invalid_transfer_encoding"),
        ("chunked, chunked", 400, "invalid_transfer_encoding"),
    ],
)
def test_transfer_codings_other_than_plain_chunked_are_refused(
    server: Server, coding: str, status: int, code: str
) -> None:
    """A body in a transfer coding the server does not decode is refused before any app reads it (it was read
    as plain text under `gzip, chunked`); plain chunked is served."""
    body = b'{"prompt": "hello"}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)

    def send(te: str) -> bytes:
        head = f"POST {server.post_path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        with connect(server.addr) as s:
            s.sendall(head.encode() + f"Transfer-Encoding: {te}\r\nConnection: close\r\n\r\n".encode() + chunked)
            raw, closed = read_until_closed(s)
        assert closed
        return raw

    raw = send(coding)
    assert status_of(raw) == status, raw[:300]
    assert error_of(raw)["code"] == code and coding.split(",")[0].strip() in error_of(raw)["message"]
    plain = send("chunked")  # the same body, plainly chunked, reaches the route (which judges its JSON)
    assert status_of(plain) != 501 and b"transfer_encoding" not in plain and b"invalid_http_request" not in plain


# ---- a client that stops reading ------------------------------------------------------------------
@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_stream_nobody_reads_is_cut_and_its_request_ended(smol_path, http: str) -> None:
    """A streaming client that stops reading (its receive window full) does not hold the stream: once no write
    makes progress for ``write_timeout_s`` the connection is dropped and the stream's clean-up runs (where the
    router aborts the request on its workers); a reading client of the same stream is not cut."""
    from common.managed_stream import ManagedStream

    app = router_app(smol_path)
    ended = threading.Event()

    async def endless() -> ManagedStream:
        async def body():  # type: ignore[no-untyped-def]
            while True:
                await asyncio.sleep(0)  # as a stream awaits its upstream between events
                yield b"data: " + b"x" * 16384 + b"\n\n"

        async def on_close() -> None:
            ended.set()

        return ManagedStream(body(), on_close, "text/event-stream")

    app.add_api_route("/v1/endless", endless, methods=["GET"])
    with ServerThread(app, limits=LIMITS, http=http) as server:
        addr = ("127.0.0.1", server.port)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(addr)
            s.sendall(get("/v1/endless"))
            assert ended.wait(CLOSED_WITHIN_S), "the unread stream was never ended"
            _, closed = read_until_closed(s)  # what was buffered, then the drop
            assert closed
        ended.clear()
        with connect(addr) as s:  # a client that keeps reading, for longer than the timeout
            s.sendall(get("/v1/endless"))
            taken, until = 0, time.monotonic() + 4 * LIMITS.write_timeout_s
            while time.monotonic() < until:
                chunk = s.recv(1 << 20)
                assert chunk, "a reading client's stream was cut"
                taken += len(chunk)
            assert taken > 0 and not ended.is_set()


# ---- connections: 503 beyond the cap ---------------------------------------------------------------
def test_connections_beyond_the_cap_get_503(smol_path) -> None:
    limits = HttpLimits(max_connections=4, header_timeout_s=30.0)
    app = router_app(smol_path, limits)
    with ServerThread(app, limits=limits) as server:
        addr = ("127.0.0.1", server.port)
        held = [connect(addr) for _ in range(limits.max_connections)]
        try:
            accepted = server.server.server_state.connections  # uvicorn's, one per accepted connection
            wait_until(lambda: len(accepted) >= len(held), 10, "the server to accept the held connections", 0.01)
            status, headers, body = request(addr, get())
            assert status == 503 and headers["content-type"] == "application/json"
            error = json.loads(body)["error"]
            assert error["code"] == "service_unavailable" and str(limits.max_connections) in error["message"]
        finally:
            for s in held:
                s.close()
        wait_until(lambda: request(addr, get())[0] == 200, CLOSED_WITHIN_S, "a request served once the held closed")


_UNITS = {"": 1, "s": 1, "KiB": 1024, "MiB": 1024 * 1024}


def test_every_limit_is_documented() -> None:
    """docs/reliability.md's table names each setting with its default."""
    from dataclasses import fields
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    section = doc.split("## HTTP limits", 1)[1].split("\n## ", 1)[0]
    documented = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2].startswith("`KVFERRY_HTTP_"):
            number, _, unit = cells[1].partition(" ")
            documented[cells[2].split("`")[1]] = float(number) * _UNITS[unit]
    defaults = HttpLimits()
    for f in fields(HttpLimits):
        name = f"KVFERRY_HTTP_{f.name.upper()}"
        assert name in documented, f"{name} is not in docs/reliability.md's table"
        assert documented[name] == getattr(defaults, f.name), name
    from router.surface.structured import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH

    assert f"| {MAX_SCHEMA_DEPTH} | `MAX_SCHEMA_DEPTH` |" in section
    assert f"| {MAX_SCHEMA_BYTES // 1024} KiB | `MAX_SCHEMA_BYTES` |" in section
