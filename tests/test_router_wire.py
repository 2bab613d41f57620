"""router/wire.py, the router's HTTP/1.1 client, against real servers: framing, keep-alive reuse, a
connection the server closed while idle, refused connections, aborts."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from common.net import free_port
from router.server_thread import ServerThread
from router.wire import ConnectError, ProtocolError, WireClient
from tests.helpers import wait_until


@pytest.fixture(scope="module")
def server():
    app = FastAPI()
    state = {"aborted": 0}

    @app.get("/json")
    async def j() -> JSONResponse:
        return JSONResponse({"ok": True, "text": "héllo 🎉"})

    @app.post("/echo")
    async def echo(body: dict) -> JSONResponse:
        return JSONResponse(body)

    @app.get("/empty")
    async def empty() -> PlainTextResponse:
        return PlainTextResponse("", status_code=204)

    @app.get("/ndjson")
    async def ndjson(n: int = 5, slow: float = 0.0) -> StreamingResponse:
        async def gen():
            try:
                for i in range(n):
                    yield (json.dumps({"i": i, "pad": "x" * (i * 1000)}) + "\n").encode()
                    await asyncio.sleep(slow)
            except asyncio.CancelledError:
                state["aborted"] += 1
                raise

        return StreamingResponse(gen(), media_type="application/x-ndjson")

    s = ServerThread(app).start()
    yield s.url, state
    s.stop()


def run(coro):
    return asyncio.run(coro)


def test_content_length_chunked_and_reuse(server) -> None:
    url, _ = server

    async def go() -> None:
        c = WireClient()
        status, body = await c.get_json_body(f"{url}/json", 5)
        assert status == 200 and json.loads(body) == {"ok": True, "text": "héllo 🎉"}
        r = await c.request("POST", f"{url}/echo", json.dumps({"a": [1, 2]}).encode())
        assert r.status == 200 and json.loads(await r.read()) == {"a": [1, 2]}
        await r.aclose()
        r = await c.request("GET", f"{url}/ndjson?n=4")
        lines = [json.loads(line) async for line in r.lines()]
        await r.aclose()
        assert [x["i"] for x in lines] == [0, 1, 2, 3] and len(lines[3]["pad"]) == 3000
        r = await c.request("GET", f"{url}/empty")
        assert r.status == 204 and await r.read() == b""
        await r.aclose()
        # Every exchange above went over one kept-alive connection.
        idle = [conn for conns in c._idle.values() for conn in conns]
        assert len(idle) == 1 and idle[0].reused
        await c.aclose()

    run(go())


def test_stale_pooled_connection_is_retried_once() -> None:
    """A keep-alive connection that the server closed while it sat in the pool: the request goes out
    again on a fresh connection instead of failing."""
    port = free_port()
    served = []

    async def go() -> None:
        closed = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            served.append(1)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            writer.close()  # close right after answering, keep-alive notwithstanding
            await writer.wait_closed()
            closed.set()

        srv = await asyncio.start_server(handle, "127.0.0.1", port)
        c = WireClient()
        for _ in range(3):
            status, body = await c.get_json_body(f"http://127.0.0.1:{port}/", 5)
            assert (status, body) == (200, b"ok")
            await asyncio.wait_for(closed.wait(), 5)  # the pooled connection is closed on the server's side
            closed.clear()
        await c.aclose()
        srv.close()
        await srv.wait_closed()

    run(go())
    assert len(served) == 3


def test_refused_and_garbage() -> None:
    async def go() -> None:
        c = WireClient(connect_timeout_s=1)
        with pytest.raises(ConnectError):
            await c.request("GET", f"http://127.0.0.1:{free_port()}/")
        port = free_port()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"SMTP ready\r\n\r\n")
            await writer.drain()
            writer.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", port)
        with pytest.raises(ProtocolError):
            await c.request("GET", f"http://127.0.0.1:{port}/")
        srv.close()
        await c.aclose()

    run(go())


def test_closing_mid_stream_aborts_the_server_side(server) -> None:
    url, state = server

    async def go() -> None:
        c = WireClient()
        r = await c.request("GET", f"{url}/ndjson?n=100&slow=0.05")
        lines = r.lines()
        assert json.loads(await lines.__anext__())["i"] == 0
        await lines.aclose()
        await r.aclose()  # not read to the end: the connection is closed, not pooled
        assert not c._idle.get(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        await c.aclose()

    before = state["aborted"]
    run(go())
    wait_until(lambda: state["aborted"] > before, 2, "the server to see the stream aborted", interval=0.02)
    assert state["aborted"] == before + 1


def test_a_cancelled_request_is_cancelled_whenever_the_cancel_comes(server) -> None:
    """Cancelled at each step of a fresh connection's life (connecting, connected, sending, reading), a
    request ends cancelled, never with a response: a cancel that arrives as the connection opens is not
    lost (Python 3.11's ``asyncio.wait_for`` returned the connection then; the router's worker polls went on
    after the pool stopped them, and a router that could not bind its port never exited)."""
    url, _ = server

    async def go() -> list[int]:
        lost = []
        for steps in range(40):
            client = WireClient(connect_timeout_s=5.0)
            task = asyncio.ensure_future(client.get_json_body(f"{url}/json", 5.0))
            for _ in range(steps):
                await asyncio.sleep(0)
            if task.done():
                break  # answered before this many steps: every earlier moment was tried
            task.cancel()
            try:
                await task
                lost.append(steps)
            except asyncio.CancelledError:
                pass
            await client.aclose()
        return lost

    assert run(go()) == []


def test_production_code_never_uses_asyncio_wait_for() -> None:
    """``asyncio.timeout`` everywhere instead: on Python 3.11 (the floor we support) ``wait_for`` loses a cancel
    that comes as what it waits for completes, the bug the test above catches in the router's connects."""
    root = Path(__file__).resolve().parents[1]
    found = []
    for path in (
        p
        for pkg in ("common", "router", "prefill_worker", "decode_worker", "mixed_worker")
        for p in (root / pkg).rglob("*.py")
    ):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "wait_for" and isinstance(node.value, ast.Name):
                if node.value.id == "asyncio":
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == [], found
