"""End to end on CPU: the official `openai` client against a local cluster (real redis-server, 2 prefill
workers and 1 decode worker running the embedded model, the router), started once for this module with
`start_local_cluster`, plus `kvferry up` itself as a command."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from common.config import RouterConfig
from common.devcluster.cluster import LocalCluster
from common.net import free_port
from common.prefix.hashing import chained_block_hashes
from common.prefix.scripts import IndexKeys
from common.settings import HttpLimits
from router.decision.discovery import StaticDiscovery
from router.server_thread import ServerThread
from router.settings import RouterOptions
from router.surface.tokenizer import ModelInfo, RouterTokenizer
from tests.helpers import load, running_cluster, wait_until
from tests.workers import start_router_thread

MODEL = "smollm2-135m-instruct"
# Small KV pools and a small prefill budget, so the tests exercise chunked prefill and pool limits.
# The shared cluster's router never prefills on the decode pod because that pod holds the prefix
# (local prefix fraction > 1): these tests are about prefill-pod locality; a default router checks the
# decode-side rule separately.
ENV = {
    "KVFERRY_NUM_PAGES": "384",
    "KVFERRY_MAX_PREFILL_TOKENS": "128",
    "KVFERRY_PAGE_SIZE": "16",
    "KVFERRY_ROUTER_LOCAL_PREFIX_FRACTION": "2",
    "KVFERRY_MAX_RUNNING": "8",  # a short batch, so the overload tests fill the decode worker's queue quickly
}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


# ---- `kvferry up` as a command (runs first: it needs the CPU the shared cluster would hold) ----------
def test_kvferry_up_command_serves_and_stops_on_ctrl_c() -> None:
    port = free_port()
    env = dict(os.environ, **ENV)
    proc = subprocess.Popen(
        [sys.executable, "-m", "common.cli", "up", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        start_new_session=True,
    )
    out: list[str] = []
    try:
        deadline = time.monotonic() + 300
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line)
            if line.startswith("-> "):  # the answer it got to the printed request, right under the curl
                break
        text = "".join(out)
        assert f"kvferry is up: http://127.0.0.1:{port}/v1" in text, text
        # It sent the printed request itself first and showed the answer.
        assert out[-1].startswith("-> ") and "Paris" in out[-1], text
        # The request it prints, as a user pastes it: greedy (temperature 0), so its answer is the right one.
        (curl_data,) = [x for x in out if x.lstrip().startswith("-d '")]
        printed = json.loads(curl_data.split("-d '", 1)[1].rsplit("'", 1)[0])
        assert printed["temperature"] == 0, printed
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=printed, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        # The workers' internal API wants the token `kvferry up` made for this run: another user of the
        # machine who finds a worker's port gets 401 and changes nothing.
        decode_url = text.split("decode-0 ready at ", 1)[1].split()[0]
        gen = {"req_id": "stranger", "token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}}
        r = httpx.post(f"{decode_url}/internal/generate", json=gen, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_internal_token", r.text
        assert httpx.get(f"{decode_url}/load", timeout=30).json()["live_requests"] == 0
        # Its Redis (the prefix index) wants a password made for this run: a stranger cannot read or steer it.
        redis_url = text.split("redis-server on ", 1)[1].split()[0]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(redis_url, socket_timeout=5).keys("*")
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "stopped" in rest
    # The log directory it made for this run goes with a clean stop (runs do not pile up in /tmp).
    log_dir = Path(text.split("workers (logs in ", 1)[1].split(")", 1)[0])
    assert log_dir.name.startswith("kvferry-up-") and not log_dir.exists(), log_dir
    # Nothing left listening: the router port is free again.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_kvferry_up_on_a_port_in_use_says_so_and_starts_nothing() -> None:
    """Another server on the router's port: `kvferry up` stops at once naming the port, instead of taking that
    server's answers for its router's and printing its URL."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "common.cli", "up", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 1, r.stderr
    assert f"port {port} on 127.0.0.1 is in use" in r.stderr and "--port" in r.stderr, r.stderr
    assert "kvferry is up" not in r.stdout and "starting" not in r.stderr, r.stderr


def test_kvferry_up_without_redis_says_how_to_install() -> None:
    env = dict(os.environ, PATH="/nonexistent")
    r = subprocess.run(
        [sys.executable, "-m", "common.cli", "up", "--port", str(free_port())],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 1
    assert "redis-server is not installed" in r.stderr and "apt-get install" in r.stderr


# ---- the shared cluster --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster(prefill=2, decode=1, env=ENV, wait_up=False) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="none", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def tok(smol_path) -> RouterTokenizer:
    return RouterTokenizer.from_dir(smol_path)


def test_a_router_port_taken_before_the_router_binds_it_is_picked_again(cluster: LocalCluster, monkeypatch) -> None:
    """`kvferry up` picks the router's port when it starts the router, after the workers are up: another process may
    bind it in between (a test suite's next cluster, a worker's listener); the router then exits and is started
    on a new port, not reported as a failed start."""
    import tempfile

    from common.devcluster import cluster as devcluster

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(devcluster, "free_port", lambda: next(picks, 0) or free_port())
        said: list[str] = []
        own = LocalCluster(
            router_url="",
            prefill_urls=[],
            decode_urls=cluster.decode_urls,
            redis_url=cluster.redis_url,
            log_dir=Path(tempfile.mkdtemp(prefix="kvferry-port-")),
            temp_log_dir=True,
        )
        try:
            devcluster.start_router(own, "127.0.0.1", 0, MODEL, dict(os.environ, **ENV), [], 120, said.append)
            assert any("was taken" in line for line in said), said
            assert not own.router_url.endswith(f":{taken}")
            assert httpx.get(f"{own.router_url}/v1/models", timeout=10).status_code == 200
        finally:
            own.stop(grace_s=2.0)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_answer_and_usage(client: openai.OpenAI, tok: RouterTokenizer) -> None:
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    choice = r.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    assert r.usage.prompt_tokens == len(tok.encode_chat(FRANCE))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 24


def test_the_workers_count_each_prompt_they_prefill_once_on_load(client: openai.OpenAI, cluster: LocalCluster) -> None:
    """The counts other router processes' placements are read from (router/decision/peers.py): one request adds its
    prompt to the worker that prefilled it, and to no other, and one request to decode to the decode worker that
    served it, and to no other."""
    urls = [*cluster.prefill_urls, *cluster.decode_urls]
    before = {u: load(u) for u in urls}
    prompt = "Count me once: " + " ".join(f"w{i}" for i in range(300))  # long enough to go to a prefill pod
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2)
    after = {u: load(u) for u in urls}
    grown = {u: after[u]["prompt_tokens_accepted"] - before[u]["prompt_tokens_accepted"] for u in urls}
    assert sorted(grown.values()) == [0] * (len(urls) - 1) + [r.usage.prompt_tokens], grown
    decodes = {u: after[u]["decodes_accepted"] - before[u]["decodes_accepted"] for u in urls}
    assert sorted(decodes.values()) == [0] * (len(urls) - 1) + [1], decodes
    assert all(decodes[u] == 0 for u in cluster.prefill_urls), decodes


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_equals_non_streamed_under_greedy(client: openai.OpenAI, endpoint: str) -> None:
    if endpoint == "chat":
        msgs = [{"role": "user", "content": "Write one sentence about the sea, with an emoji."}]
        full = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=40)
        parts = client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(parts)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == full.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    else:
        prompt = "The three largest cities in Japan are"
        full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40)
        parts = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stream=True)
        assert "".join(c.choices[0].text for c in parts) == full.choices[0].text
        assert full.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_count_each_choice_as_it_streams(client: openai.OpenAI, endpoint: str) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far, and the
    stream still ends with the whole request's usage."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model=MODEL, temperature=0, max_tokens=12, n=2, stream=True, stream_options=opts)
    if endpoint == "chat":
        chunks = list(client.chat.completions.create(messages=FRANCE, logprobs=True, **kw))  # type: ignore[call-overload]
    else:
        chunks = list(client.completions.create(prompt="The capital of France is", logprobs=0, **kw))  # type: ignore[call-overload]
    *body, last = chunks
    assert not last.choices
    counts = {0: 0, 1: 0}  # tokens each choice's chunks have carried so far (their logprobs list them)
    for c in body:
        assert c.usage.prompt_tokens == last.usage.prompt_tokens  # one prompt
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        for choice in c.choices:  # one, or both in chat's opening chunk (0 tokens yet)
            lp = choice.logprobs
            counts[choice.index] += len((lp.content if endpoint == "chat" else lp.tokens) or []) if lp else 0
            assert c.usage.completion_tokens == counts[choice.index]
    assert all(0 < n <= 12 for n in counts.values())
    assert last.usage.completion_tokens == counts[0] + counts[1]


def test_echo_puts_the_prompt_before_the_output(client: openai.OpenAI, tok: RouterTokenizer) -> None:
    prompt = "The three largest cities in Japan are"
    kw = dict(model=MODEL, temperature=0, max_tokens=8)
    plain = client.completions.create(prompt=prompt, **kw).choices[0].text  # type: ignore[call-overload]
    echoed = client.completions.create(prompt=prompt, echo=True, **kw)  # type: ignore[call-overload]
    assert echoed.choices[0].text == prompt + plain
    assert echoed.usage.prompt_tokens == len(tok.encode(prompt))
    chunks = client.completions.create(prompt=prompt, echo=True, stream=True, **kw)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks) == prompt + plain
    ids = tok.encode(prompt)  # a token-id prompt echoes as its text
    by_ids = client.completions.create(prompt=[ids, ids[:3]], echo=True, **kw)  # type: ignore[call-overload]
    assert by_ids.choices[0].text == prompt + plain and by_ids.choices[1].text.startswith(tok.decode(ids[:3]))


def test_stop_strings(client: openai.OpenAI) -> None:
    prompt = "Count from one to ten in words: one, two,"
    base = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24).choices[0].text
    stop = base.strip().split()[2][:3]  # a piece from the middle of the greedy answer
    cut = base[: base.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24, stop=[stop, "@@@"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=24, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_n_and_seed_reproducibility(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a color."}], temperature=1.0, max_tokens=12)
    a = client.chat.completions.create(n=2, seed=1234, **kw)  # type: ignore[arg-type]
    b = client.chat.completions.create(n=2, seed=1234, **kw)  # type: ignore[arg-type]
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    # Choice i of a seeded request is the single request seeded seed + i; usage sums the choices.
    singles = [client.chat.completions.create(seed=1234 + i, **kw) for i in range(2)]  # type: ignore[arg-type]
    assert [s.choices[0].message.content for s in singles] == [c.message.content for c in a.choices]
    assert a.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_logprobs(client: openai.OpenAI, tok: RouterTokenizer) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4
    text_bytes = b"".join(bytes(e.bytes) for e in content)
    assert text_bytes.decode(errors="replace").startswith(r.choices[0].message.content)
    c = client.completions.create(
        model=MODEL, prompt="Paris is the capital of", temperature=0, max_tokens=5, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == c.choices[0].text
    # Sampled, the chosen token may be outside the top ones: the legacy shape still lists it (as OpenAI and
    # vLLM do: up to logprobs + 1 entries), and logprobs=0 lists only it.
    for k in (0, 1):
        kw = dict(model=MODEL, prompt="Name a fruit:", temperature=2.0, seed=11, max_tokens=16, logprobs=k)
        lp = client.completions.create(**kw).choices[0].logprobs  # type: ignore[call-overload]
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[token] == logprob and len(top) <= k + 1
        assert k == 0 or any(len(top) == 2 for top in lp.top_logprobs)  # temperature 2 leaves the top at times


def test_error_cases(client: openai.OpenAI, cluster: LocalCluster) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=FRANCE)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=9000)
    assert e.value.code == "context_length_exceeded"
    # Fits the context but not what one request may take of the decode worker's small KV pool.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=7000)
    assert e.value.code == "request_too_large" and "more than one request may take" in e.value.message
    r = httpx.post(f"{cluster.router_url}/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_error_cases_needing_other_router_settings(cluster: LocalCluster, tok: RouterTokenizer, smol_path) -> None:
    """401, 413, 429 and 503 from routers (in this process) configured for them, over the same workers."""
    from router.app import create_app

    info = ModelInfo.from_dir(MODEL, smol_path)

    def router(
        api_key: str | None, decode: list[str], limits: HttpLimits | None = None, **opts: object
    ) -> ServerThread:
        app = create_app(
            RouterConfig(model=MODEL, api_key=api_key, redis_url=cluster.redis_url),
            RouterOptions(poll_interval_s=0.2, **opts),  # type: ignore[arg-type]
            tokenizer=tok,
            model_info=info,
            discovery=StaticDiscovery(cluster.prefill_urls, decode),
            http_limits=limits,
        )
        return ServerThread(app, limits=limits).start()

    with router("sekrit", cluster.decode_urls, HttpLimits(max_body_bytes=2048)) as s:
        wait_until(lambda: httpx.get(f"{s.url}/ready").status_code == 200, 10, "the side router ready")
        bad = openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=MODEL, messages=FRANCE)
        good = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekrit", max_retries=0, timeout=120)
        assert (
            "Paris"
            in good.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0).choices[0].message.content
        )
        with pytest.raises(openai.APIStatusError) as e:
            good.completions.create(model=MODEL, prompt="x" * 5000)
        assert e.value.status_code == 413
    with router(None, cluster.decode_urls, max_inflight=0, retry_after_s=2) as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": FRANCE})
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
    with router(None, ["http://127.0.0.1:9"]) as s:  # a decode worker that is not there
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": FRANCE})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert httpx.get(f"{s.url}/ready").status_code == 503


# ---- prefix routing --------------------------------------------------------------------------------
def _published(cluster: LocalCluster, worker_url: str, token_ids: list[int]) -> bool:
    """The Redis prefix index (common/prefix/scripts.py) lists every full block of ``token_ids`` under the
    worker's pod: what the router's locality lookup reads."""
    ld = load(worker_url)
    keys = IndexKeys(MODEL)
    with redis.Redis.from_url(cluster.redis_url) as r:
        return all(r.sismember(keys.block(h), ld["pod"]) for h in chained_block_hashes(token_ids, ld["page_size"]))


def _system_prompt(topic: str) -> str:
    return (f"You are an expert on {topic}. Answer briefly, precisely and politely. " * 30).strip()


def test_prefix_routing_lands_on_the_worker_holding_the_system_prompt(
    client: openai.OpenAI, cluster: LocalCluster, tok: RouterTokenizer
) -> None:
    results: dict[str, list[int]] = {}
    for topic in ("astronomy", "botany"):
        system = _system_prompt(topic)
        shared = len(tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": ""}]))
        cached = []
        for q in ("What is it?", "Tell me more.", "Why?", "Give an example."):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=4)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
        results[topic] = cached
        # The first request computes the prefix; every later one finds (nearly) all of it cached,
        # i.e. lands on the prefill worker that holds it.
        assert cached[0] == 0
        assert all(c >= shared - 32 for c in cached[1:]), (topic, cached, shared)
    stats = httpx.get(f"{cluster.router_url}/router/workers").json()
    assert stats["decisions"].get("disaggregated", 0) >= 8 and "decode-holds-prefix" not in stats["decisions"]
    assert stats["prefix_index"] == "ok"


def test_default_router_prefills_on_the_decode_pod_holding_the_prefix(
    cluster: LocalCluster, tok: RouterTokenizer, smol_path
) -> None:
    """With default options, a long prompt whose prefix the decode pod already holds (it received that
    KV for an earlier request) is prefilled there: conditional disaggregation."""
    from router.app import create_app

    app = create_app(
        RouterConfig(model=MODEL, redis_url=cluster.redis_url),
        RouterOptions(poll_interval_s=0.2),
        tokenizer=tok,
        model_info=ModelInfo.from_dir(MODEL, smol_path),
        discovery=StaticDiscovery(cluster.prefill_urls, cluster.decode_urls),
    )
    with ServerThread(app) as s:
        wait_until(
            lambda: (
                httpx.get(f"{s.url}/ready").status_code == 200
                and all(w["up"] for w in httpx.get(f"{s.url}/router/workers").json()["workers"])
            ),
            10,
            "the side router ready with every worker up",
        )
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=180)
        system = _system_prompt("zoology")
        cached = []
        for q in ("What is a cat?", "What is a dog?", "And a bird?"):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            r = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=4)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            # The decode pod publishes what it holds in batches: the next request is placed once it has.
            ids = tok.encode_chat(msgs)
            wait_until(lambda ids=ids: _published(cluster, cluster.decode_urls[0], ids), 30, "its blocks published")
        decisions = httpx.get(f"{s.url}/router/workers").json()["decisions"]
    assert decisions.get("disaggregated") == 1 and decisions.get("decode-holds-prefix") == 2, decisions
    assert cached[0] == 0 and min(cached[1:]) > 400, cached


def test_a_decode_worker_without_the_prefill_peer_prefills_the_prompt_itself(
    cluster: LocalCluster, tok: RouterTokenizer, smol_path, caplog: pytest.LogCaptureFixture
) -> None:
    """A router that names the prefill workers by an address the decode worker was not configured with
    (``localhost`` where its KVFERRY_PREFILL_PEERS says 127.0.0.1: what an upgrade that kept old settings
    looks like) gets 403 ``unknown_prefill_peer`` for a long prompt; it retries with the prompt prefilled on
    the decode worker, so the client gets its answer, and the log names the setting to set."""
    from router.app import create_app

    elsewhere = [u.replace("127.0.0.1", "localhost") for u in cluster.prefill_urls]
    app = create_app(
        RouterConfig(model=MODEL, redis_url=cluster.redis_url),
        RouterOptions(poll_interval_s=0.2),
        tokenizer=tok,
        model_info=ModelInfo.from_dir(MODEL, smol_path),
        discovery=StaticDiscovery(elsewhere, cluster.decode_urls),
    )
    with caplog.at_level("WARNING", logger="kvferry"), start_router_thread(app) as s:
        msgs = [{"role": "system", "content": _system_prompt("geology")}, *FRANCE]
        body = {"messages": msgs, "temperature": 0, "max_tokens": 8}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] >= 256
        decisions = httpx.get(f"{s.url}/router/workers").json()["decisions"]
    assert decisions.get("disaggregated") == 1 and decisions.get("no-prefill") == 1, decisions
    refused = [rec.getMessage() + str(getattr(rec, "error", "")) for rec in caplog.records]
    assert any("KVFERRY_PREFILL_PEERS" in m for m in refused), refused


def test_redis_stopped_mid_run_requests_still_succeed(client: openai.OpenAI, cluster: LocalCluster) -> None:
    system = _system_prompt("geology")
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is a rock?"}]
    assert client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=4).choices
    cluster.stop_redis()
    try:
        for q in ("What is sand?", "What is lava?", "Why?"):
            m = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            r = client.chat.completions.create(model=MODEL, messages=m, temperature=0, max_tokens=4)
            assert r.choices[0].message.content is not None
        stream = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, stream=True)
        assert "Paris" in "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        stats = httpx.get(f"{cluster.router_url}/router/workers").json()
        assert stats["prefix_index"] == "unavailable"
    finally:
        cluster.start_redis()

    # Redis is back (empty): the router notices by itself (at a request's lookup), the workers resync, prefix
    # routing resumes.
    def prefix_routing_back() -> bool:
        client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=2)
        return httpx.get(f"{cluster.router_url}/router/workers").json()["prefix_index"] == "ok"

    wait_until(prefix_routing_back, 30, "the router to use the prefix index again", interval=0.5)


# ---- overload: 200 or 429, never 5xx -------------------------------------------------------------------
def _side_router(cluster: LocalCluster, tok: RouterTokenizer, smol_path, **opts: object) -> ServerThread:
    """A router in this process over the shared cluster's workers, with its own options; returned
    started, once it sees every worker up."""
    from router.app import create_app

    app = create_app(
        RouterConfig(model=MODEL, redis_url=cluster.redis_url),
        RouterOptions(**opts),  # type: ignore[arg-type]
        tokenizer=tok,
        model_info=ModelInfo.from_dir(MODEL, smol_path),
        discovery=StaticDiscovery(cluster.prefill_urls, cluster.decode_urls),
    )
    return start_router_thread(app)


async def _burst(url: str, n: int, max_tokens: int) -> list[tuple[int, str | None, str]]:
    """``n`` concurrent requests (every other one streamed); per request: status, Retry-After, and the
    body (the streamed text for a streamed 200)."""
    import asyncio

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str | None, str]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": i % 2 == 1,
        }
        async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            text = (await r.aread()).decode()
            return r.status_code, r.headers.get("retry-after"), text

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as c:
        return list(await asyncio.gather(*(one(c, i) for i in range(n))))


def _assert_200_or_429(results: list[tuple[int, str | None, str]], max_tokens: int) -> list[str]:
    """Every answer is a complete 200 or a 429 with Retry-After and an OpenAI error body; returns the
    429s' messages."""
    import json

    rejected = []
    for status, retry_after, text in results:
        assert status in (200, 429), (status, text)
        if status == 429:
            assert retry_after is not None and int(retry_after) >= 1
            err = json.loads(text)["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
            rejected.append(err["message"])
        elif text.startswith("data: "):  # streamed: complete, no error event inside the 200
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-300:]
        else:
            assert json.loads(text)["usage"]["completion_tokens"] == max_tokens
    return rejected


def test_overload_is_answered_429_never_5xx(cluster: LocalCluster, tok: RouterTokenizer, smol_path) -> None:
    """A router whose admission limit is 4 waiting requests per decode worker, hit by 24 at once: the
    excess gets 429 + Retry-After before anything starts, the rest complete, nothing is a 5xx, and the
    cluster serves normally right after."""
    import asyncio

    # The waiting-queue rule alone (the TTFT prediction would refuse some of the burst first: its own tests are
    # tests/test_slo_admission.py).
    with _side_router(cluster, tok, smol_path, admit_max_waiting=4, poll_interval_s=0.1, admit_by_ttft=False) as s:
        results = asyncio.run(_burst(s.url, 24, max_tokens=8))
        rejected = _assert_200_or_429(results, 8)
        assert 0 < len(rejected) < len(results), [r[0] for r in results]
        assert all("admission limits" in m for m in rejected), rejected
        decisions = httpx.get(f"{s.url}/router/workers").json()["decisions"]
        assert decisions.get("rejected-decode-full") == len(rejected), decisions
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 8}, timeout=60)
        assert r.status_code == 200, r.text


def test_worker_with_a_full_queue_answers_429_and_the_router_passes_it_on(
    cluster: LocalCluster, tok: RouterTokenizer, smol_path
) -> None:
    """With the router's own admission off, the decode worker's queue (ENV: 8 running at most) fills up:
    the worker refuses with 429, the router, having no other decode worker to retry on, answers 429 +
    Retry-After; never a 5xx; the worker keeps serving."""
    import asyncio

    decode_url = cluster.decode_urls[0]

    async def two_waves(url: str) -> list[tuple[int, str | None, str]]:
        first = asyncio.ensure_future(_burst(url, 24, max_tokens=32))
        async with httpx.AsyncClient() as c:  # the first wave fills the batch and the queue behind it
            while (await c.get(f"{decode_url}/load")).json()["waiting_requests"] < 8:
                assert not first.done(), "the first wave never filled the queue"
                await asyncio.sleep(0.02)
        second = await _burst(url, 8, max_tokens=4)
        return [*await first, *second]

    off = dict(admit_max_waiting=0, admit_max_queued_prefill_tokens=0, admit_by_ttft=False)
    with _side_router(cluster, tok, smol_path, **off) as s:
        results = asyncio.run(two_waves(s.url))
    rejected = _assert_200_or_429(results[:24], 32) + _assert_200_or_429(results[24:], 4)
    assert rejected and all("engine queue is full" in m for m in rejected), rejected
    r = httpx.post(f"{cluster.router_url}/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_worker_too_busy_to_answer_its_polls_is_not_declared_down(
    cluster: LocalCluster, tok: RouterTokenizer, smol_path
) -> None:
    """The decode worker's control plane frozen for 2.5 s (SIGSTOP; its engine runs on): the router's
    polls time out, so the worker turns stale, but it stays up: the stream in flight finishes whole, and
    a request sent meanwhile waits for it and succeeds (it was a 503 when a slow poll meant down)."""
    import threading

    part = next(p for p in cluster.parts if p.url == cluster.decode_urls[0])
    assert part.proc is not None
    opts = dict(poll_interval_s=0.1, poll_timeout_s=0.3, down_after_failures=3, down_after_s=5.0)
    with _side_router(cluster, tok, smol_path, **opts) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        it = iter(stream)
        texts = [next(it).choices[0].text]
        during: dict[str, httpx.Response] = {}
        os.kill(part.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: _decode_entry(s.url)["stale"], 10, "polls of the frozen worker failing")
            sender = threading.Thread(
                target=lambda: during.setdefault(
                    "r", httpx.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
                )
            )
            sender.start()
            # More polls failed in a row than down_after_failures, the new request waiting on the worker: it
            # stays up while it was heard from within down_after_s.
            decode = wait_until(
                lambda: (e := _decode_entry(s.url))["poll_failures"] > 3 and e["inflight_requests"] == 2 and e,
                10,
                "polls of the frozen worker failing with the new request placed on it",
            )
            assert decode["up"] and decode["stale"], decode
        finally:
            os.kill(part.proc.pid, signal.SIGCONT)
        chunks = list(it)
        texts += [c.choices[0].text for c in chunks]
        assert chunks[-1].choices[0].finish_reason == "length"
        sender.join(60)
        assert during["r"].status_code == 200, during["r"].text
        wait_until(lambda: not _decode_entry(s.url)["stale"], 10, "the worker answering again fresh again")


def _decode_entry(router_url: str) -> dict:
    return next(w for w in httpx.get(f"{router_url}/router/workers").json()["workers"] if w["role"] == "decode")


# ---- adaptive placement (router/decision/cost_model.py) ---------------------------------------------------------
def _measured(router_url: str) -> tuple[bool, bool]:
    """(the decode worker has a prefill rate, some prefill worker has one), as /router/workers shows."""
    view = httpx.get(f"{router_url}/router/workers").json()
    rates = view["placement"]["workers"]
    roles = {w["url"]: w["role"] for w in view["workers"]}
    has = [roles[u] for u, r in rates.items() if r["prefill_tokens_per_s"] > 0]
    return "decode" in has, "prefill" in has


def test_adaptive_placement_serves_what_fixed_placement_serves(
    cluster: LocalCluster, tok: RouterTokenizer, smol_path
) -> None:
    """Once the workers have measured their prefill rates, an adaptive router places by the cost model
    (its reason counted and shown) and a greedy answer equals the fixed router's."""
    # Warm-up: long prompts queued on the decode pod (a fixed router that never disaggregates) and on the
    # prefill pods (the shared fixed router) make both roles measure a rate while the adaptive router polls.
    local_only = _side_router(cluster, tok, smol_path, disagg_min_prompt_tokens=10**6, poll_interval_s=0.05)
    adaptive = _side_router(cluster, tok, smol_path, placement="adaptive", poll_interval_s=0.05)
    try:

        async def warm() -> None:
            async with httpx.AsyncClient(timeout=180) as c:
                reqs = []
                for i, url in enumerate([local_only.url] * 3 + [cluster.router_url] * 3):
                    body = {"model": MODEL, "prompt": _system_prompt(f"topic {i}"), "max_tokens": 1}
                    reqs.append(c.post(f"{url}/v1/completions", json=body))
                for r in await asyncio.gather(*reqs):
                    assert r.status_code == 200, r.text

        deadline = time.monotonic() + 60
        while _measured(adaptive.url) != (True, True):
            assert time.monotonic() < deadline, httpx.get(f"{adaptive.url}/router/workers").json()["placement"]
            asyncio.run(warm())
        before = httpx.get(f"{adaptive.url}/router/workers").json()["decisions"]
        msgs = [{"role": "system", "content": _system_prompt("botany")}, {"role": "user", "content": "A tree?"}]
        answers = []
        for url in (adaptive.url, cluster.router_url):
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=180)
            r = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=12)
            answers.append(r.choices[0].message.content)
        after = httpx.get(f"{adaptive.url}/router/workers").json()
    finally:
        adaptive.stop()
        local_only.stop()
    moved = {k: v - before.get(k, 0) for k, v in after["decisions"].items() if v != before.get(k, 0)}
    assert len(moved) == 1 and next(iter(moved)).startswith("adaptive-"), moved
    assert (
        after["placement"]["mode"] == "adaptive" and after["placement"]["slo_default_class"]["itl_s"] == 0.05
    )  # the declared default class's
    assert answers[0] and answers[0] == answers[1], answers
