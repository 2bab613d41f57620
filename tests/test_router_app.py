"""The router over real HTTP against stub workers (router/stub_worker.py speaks the worker contract with a
token script instead of a model): response shapes through the official `openai` client, retries,
failover from a SIGSTOPped pod, client disconnects, prefix routing with a real Redis index."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from common.config import RouterConfig
from router.discovery import StaticDiscovery
from router.settings import RouterOptions
from router.stub_worker import ServerThread, StubBehaviour, StubWorker, free_port
from router.tokenizer import ModelInfo, RouterTokenizer

MODEL = "smollm2-135m-instruct"
TEXT = "Hello world! 你好 🎉 done."


@pytest.fixture(scope="module")
def tok(smol_tokenizer) -> RouterTokenizer:
    return RouterTokenizer(smol_tokenizer)


@pytest.fixture(scope="module")
def info(smol_path) -> ModelInfo:
    return ModelInfo.from_dir(MODEL, smol_path)


@pytest.fixture(scope="module")
def script(tok: RouterTokenizer) -> list[int]:
    return tok.encode(TEXT)


class Harness:
    def __init__(self, tok: RouterTokenizer, info: ModelInfo) -> None:
        self.tok, self.info = tok, info
        self.servers: list[ServerThread] = []

    def worker(self, role: str, pod: str, b: StubBehaviour | None = None) -> tuple[StubWorker, str]:
        w = StubWorker(role, pod, b)
        s = ServerThread(w.app).start()
        self.servers.append(s)
        return w, s.url

    def router(
        self,
        decode: list[str],
        prefill: list[str] = (),  # type: ignore[assignment]
        redis_url: str | None = None,
        api_key: str | None = None,
        **opts: object,
    ) -> str:
        from router.app import create_app

        options = RouterOptions(**{"poll_interval_s": 0.2, "poll_timeout_s": 0.5, **opts})  # type: ignore[arg-type]
        cfg = RouterConfig(model=MODEL, redis_url=redis_url or "", api_key=api_key)
        app = create_app(
            cfg,
            options,
            tokenizer=self.tok,
            model_info=self.info,
            discovery=StaticDiscovery(prefill, decode),
            use_redis=redis_url is not None,
        )
        s = ServerThread(app).start()
        self.servers.append(s)
        wait_for(lambda: httpx.get(f"{s.url}/ready").status_code == 200, what="router ready")
        n_up = len(decode) + len(prefill)
        wait_for(lambda: sum(w["up"] for w in workers(s.url, api_key)) == n_up, what="all workers up")
        return s.url

    def close(self) -> None:
        for s in reversed(self.servers):
            s.stop()


def workers(url: str, api_key: str | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{url}/router/workers", headers=headers).json()["workers"]


def wait_for(pred: Callable[[], bool], timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def h(tok: RouterTokenizer, info: ModelInfo) -> Iterator[Harness]:
    harness = Harness(tok, info)
    try:
        yield harness
    finally:
        harness.close()


def oai(url: str, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)  # type: ignore[arg-type]


MSG = [{"role": "user", "content": "hi"}]


# ---- shapes ----------------------------------------------------------------------------------------
def test_chat_stream_equals_non_stream_and_usage(h: Harness, script: list[int]) -> None:
    d, durl = h.worker("decode", "d0", StubBehaviour(script=script, cached_tokens=16))
    url = h.router([durl])
    c = oai(url)
    full = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=len(script), temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.content == TEXT
    assert full.choices[0].finish_reason == "length" and full.choices[0].message.role == "assistant"
    u = full.usage
    assert u.completion_tokens == len(script) and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens == len(d.received[0]["token_ids"]) and u.prompt_tokens_details.cached_tokens == 16
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=MSG,
            max_tokens=len(script),
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == TEXT
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(script)
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_stream_and_eos_finish(h: Harness, script: list[int]) -> None:
    _, durl = h.worker("decode", "d0", StubBehaviour(script=script, eos_id=2))
    url = h.router([durl])
    c = oai(url)
    full = c.completions.create(model=MODEL, prompt="Say hi", max_tokens=100, temperature=0)
    assert full.object == "text_completion" and full.choices[0].text == TEXT
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == len(script) + 1  # the EOS token counts, its text is empty
    streamed = c.completions.create(model=MODEL, prompt="Say hi", max_tokens=100, temperature=0, stream=True)
    parts = list(streamed)
    assert "".join(p.choices[0].text for p in parts) == TEXT and parts[-1].choices[0].finish_reason == "stop"


def test_logprobs_shapes(h: Harness, script: list[int], tok: RouterTokenizer) -> None:
    _, durl = h.worker("decode", "d0", StubBehaviour(script=script))
    url = h.router([durl])
    c = oai(url)
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    first = content[0]
    assert first.token == tok.token_str(script[0]) and first.logprob == -0.25
    assert first.bytes == list(tok.token_bytes(script[0])) and len(first.top_logprobs) == 2
    assert b"".join(bytes(e.bytes) for e in content) == b"".join(tok.token_bytes(t) for t in script[:5])
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and all(isinstance(t, dict) and len(t) <= 3 for t in lp.top_logprobs)
    # Streamed completions carry the same logprobs, split across chunks.
    toks = []
    for ch in c.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0, logprobs=3, stream=True):
        if ch.choices[0].logprobs:
            toks += ch.choices[0].logprobs.tokens
    assert toks == lp.tokens
    # No logprobs asked: none sent.
    assert c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).choices[0].logprobs is None


def test_stop_string_trims_and_aborts_upstream(h: Harness, script: list[int]) -> None:
    d, durl = h.worker("decode", "d0", StubBehaviour(script=script, token_delay_s=0.01))
    url = h.router([durl])
    c = oai(url)
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=200, temperature=0, stop=["你好", "zzz"])
    assert r.choices[0].message.content == "Hello world! " and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 200
    wait_for(lambda: d.aborted == 1 and d.active == 0, what="upstream aborted after the stop string")
    streamed = c.completions.create(model=MODEL, prompt="x", max_tokens=200, temperature=0, stop="🎉", stream=True)
    parts = list(streamed)
    assert (
        "".join(p.choices[0].text for p in parts) == "Hello world! 你好 "
        and parts[-1].choices[0].finish_reason == "stop"
    )


def test_n_choices_and_seeds(h: Harness, script: list[int]) -> None:
    d, durl = h.worker("decode", "d0", StubBehaviour(script=script))
    url = h.router([durl])
    c = oai(url)
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=1.0, seed=7, n=2)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert sorted(b["sampling"]["seed"] for b in d.received) == [7, 8]
    prompt_len = len(d.received[0]["token_ids"])
    assert r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == 8  # prompt counted once
    again = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=1.0, seed=7, n=2)
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in r.choices]
    seen: dict[int, str] = {}
    for ch in c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=0, n=3, stream=True):
        for choice in ch.choices:
            seen[choice.index] = seen.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(seen) == [0, 1, 2] and len(set(seen.values())) == 1
    # Batched prompts x n: index = prompt * n + choice.
    batch = c.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, temperature=0, n=2)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]


# ---- failures and retries ------------------------------------------------------------------------
def test_retry_on_another_decode_pod_before_first_token(h: Harness, script: list[int]) -> None:
    bad, bad_url = h.worker("decode", "d-bad", StubBehaviour(script=script, fail_status=503, fail_count=100))
    good, good_url = h.worker("decode", "d-good", StubBehaviour(script=script))
    url = h.router([bad_url, good_url])
    c = oai(url)
    for _ in range(4):  # whichever pod the policy picks first, every request succeeds
        assert c.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0).choices[0].text
    assert len(good.received) == 4 and len(bad.received) >= 1


def test_worker_error_event_with_prefill_retries_without_that_prefill(h: Harness, script: list[int]) -> None:
    d, durl = h.worker("decode", "d0", StubBehaviour(script=script, error_event_count=1))
    _, purl = h.worker("prefill", "p0")
    url = h.router([durl], [purl], disagg_min_prompt_tokens=4)
    r = oai(url).completions.create(model=MODEL, prompt="a fairly long prompt here", max_tokens=3, temperature=0)
    assert r.choices[0].text
    # First attempt went through the prefill pod and failed; the retry prefilled on the decode pod.
    assert [b["prefill_url"] for b in d.received] == [purl, None]
    assert d.received[1]["req_id"].endswith("-retry1")


def test_all_busy_is_429_and_bad_request_passes_through(h: Harness, script: list[int]) -> None:
    _, u1 = h.worker("decode", "d0", StubBehaviour(fail_status=429, fail_count=100))
    _, u2 = h.worker("decode", "d1", StubBehaviour(fail_status=429, fail_count=100))
    url = h.router([u1, u2])
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] and r.json()["error"]["type"] == "rate_limit_error"
    b400, u3 = h.worker("decode", "d2", StubBehaviour(fail_status=400, fail_count=100))
    url2 = h.router([u3])
    r = httpx.post(f"{url2}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 400 and "stub failure" in r.json()["error"]["message"]
    assert len(b400.received) == 1  # a client error is not retried


def test_failure_after_first_token(h: Harness, script: list[int]) -> None:
    # The worker's stream breaks mid-generation (connection dropped without the final chunk): tokens
    # already sent cannot be retried, so the client gets an OpenAI-shaped error, in-stream or as a 502.
    _, durl = h.worker("decode", "d0", StubBehaviour(script=script, break_after=5))
    url = h.router([durl])
    c = oai(url)
    got = []
    with pytest.raises(openai.APIError) as e:
        for ch in c.completions.create(model=MODEL, prompt="x", max_tokens=500, temperature=0, stream=True):
            got.append(ch.choices[0].text)
    assert "".join(got) and "generation failed" in str(e.value)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 500, "temperature": 0})
    assert r.status_code == 502 and r.json()["error"]["type"] == "server_error"


def test_client_disconnect_aborts_upstream(h: Harness, script: list[int]) -> None:
    d, durl = h.worker("decode", "d0", StubBehaviour(script=script, token_delay_s=0.05))
    url = h.router([durl])
    body = {"prompt": "x", "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    wait_for(lambda: d.aborted == 1 and d.active == 0, what="stream abort reaching the worker")
    # Non-streaming: the client gives up; the worker stops too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=0.5)
    wait_for(lambda: d.aborted == 2 and d.active == 0, what="non-streaming abort reaching the worker")
    wait_for(lambda: httpx.get(f"{url}/router/workers").json()["inflight"] == 0, what="router inflight back to 0")


def test_sigstopped_decode_pod_fails_over(h: Harness) -> None:
    procs = []
    urls = []
    for i in range(2):
        port = free_port()
        argv = [sys.executable, "-m", "router.stub_worker", "--role", "decode", "--port", str(port), "--pod", f"s{i}"]
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for u in urls:
            wait_for(lambda u=u: httpx.get(f"{u}/ready").status_code == 200, what=f"stub {u}")
        url = h.router(urls, poll_timeout_s=0.5, down_after_failures=2)
        c = oai(url, timeout=30)
        os.kill(procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        for _ in range(4):  # requests routed to the stopped pod are retried once it is declared down
            assert c.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0).choices[0].text
        assert time.monotonic() - t0 < 10

        def up() -> dict[str, bool]:
            return {w["url"]: w["up"] for w in workers(url)}

        wait_for(lambda: up() == {urls[0]: False, urls[1]: True}, what="stopped pod marked down")
        os.kill(procs[0].pid, signal.SIGCONT)
        wait_for(lambda: up() == {urls[0]: True, urls[1]: True}, what="pod back up after SIGCONT")
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
            p.wait(10)


def test_auth_on_the_wire(h: Harness) -> None:
    _, durl = h.worker("decode", "d0")
    url = h.router([durl], api_key="k1")
    with pytest.raises(openai.AuthenticationError):
        oai(url, api_key="wrong").models.list()
    assert oai(url, api_key="k1").models.list().data[0].id == MODEL


# ---- prefix routing with a real Redis index ---------------------------------------------------------
def test_prefix_routing_and_redis_outage(h: Harness, tok: RouterTokenizer) -> None:
    from common.prefix.hashing import chained_block_hashes
    from common.prefix.index import PrefixIndexPublisher
    from tests.conftest_redis import start_redis, stop_redis

    port = free_port()
    redis_proc = start_redis(port)
    redis_url = f"redis://127.0.0.1:{port}/0"
    pubs = []
    try:
        d, durl = h.worker("decode", "d0")
        _, p0 = h.worker("prefill", "p0")
        _, p1 = h.worker("prefill", "p1")
        url = h.router([durl], [p0, p1], redis_url=redis_url, disagg_min_prompt_tokens=32, recent_route_ttl_s=0.0)
        system = "You are a meticulous assistant. " * 40
        prompt_ids = tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "q"}])
        # p1 publishes the shared system prompt's blocks, as a worker that prefilled it would.
        pub = PrefixIndexPublisher(redis_url, MODEL, "p1", flush_interval_s=0.01)
        pubs.append(pub)
        pub.start()
        pub.stored(chained_block_hashes(prompt_ids[: len(prompt_ids) - 20], 16))
        assert pub.wait_idle(5.0)
        c = oai(url)
        for q in ("q", "another question", "third"):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
        assert [b["prefill_url"] for b in d.received] == [p1, p1, p1]
        # Redis goes away: requests still succeed, routed on load alone (alternating between pods).
        stop_redis(redis_proc)
        for i in range(4):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]
            assert c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2).choices[0].message.content
        assert {b["prefill_url"] for b in d.received[3:]} == {p0, p1}
        assert httpx.get(f"{url}/router/workers").json()["prefix_index"] == "unavailable"
    finally:
        for p in pubs:
            p.stop()
        stop_redis(redis_proc)


def test_sse_wire_format(h: Harness, script: list[int]) -> None:
    _, durl = h.worker("decode", "d0", StubBehaviour(script=script))
    url = h.router([durl])
    body = {"messages": MSG, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"


def test_worker_missing_health_polls_keeps_live_streams_but_stalled_ones_end(h: Harness, script: list[int]) -> None:
    """A decode pod that stops answering /load is declared down. A stream still producing tokens from
    it is not cut (the pod may only be too busy for its polls); one that has stopped ends with an error
    within the stall grace, long before the inter-token deadline."""
    b = StubBehaviour(script=script, token_delay_s=0.05)
    d, durl = h.worker("decode", "d0", b)
    url = h.router([durl], poll_timeout_s=0.3, down_after_failures=2)
    c = oai(url, timeout=60)
    stream = c.completions.create(model=MODEL, prompt="x", max_tokens=80, temperature=0, stream=True)
    b.load_hang = True  # from now on the pool's polls time out
    text = "".join(ch.choices[0].text for ch in stream)
    assert len(text) > 0 and d.completed == 1  # 80 tokens x 50 ms: well past the pod's "down" mark
    assert not workers(url)[0]["up"]
    # A stream that stops: ends in error within the grace period after the pod is down.
    b.load_hang = False
    wait_for(lambda: workers(url)[0]["up"], what="pod back up")
    b.stall_after = 3
    stream = c.completions.create(model=MODEL, prompt="x", max_tokens=80, temperature=0, stream=True)
    b.load_hang = True
    t0 = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 15
