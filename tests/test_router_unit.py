"""Router pieces without workers: detokenizer, stop strings, request validation, routing policy."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import RouterConfig
from common.settings import HttpLimits
from router.decision.discovery import StaticDiscovery
from router.decision.locality import RecentPlacements
from router.decision.policy import DecodeCandidate, PolicyConfig, PrefillCandidate, RoutingPolicy
from router.settings import RouterOptions
from router.surface.detokenizer import IncrementalDetokenizer, StopMatcher
from router.surface.tokenizer import ModelInfo, PromptTooLong, RouterTokenizer
from tests.helpers import assert_openai_error

MULTILINGUAL = [
    "Hello, world!",
    "naïve café — déjà vu",
    "日本語のテキストと中文字符",
    "emoji: 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "mixed 한국어 text with ZWJ 👨‍💻 and combining e\u0301",
    "  leading spaces and\ttabs\nnewlines  ",
    "\U0001f600" * 5 + "x",
]


# ---- fake tokenizers (plain functions: what matters is what decode does to byte sequences) ----------
def byte_decode(ids: list[int]) -> str:
    """A byte-fallback tokenizer: every token is one raw byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def sp_decode(ids: list[int]) -> str:
    """SentencePiece-like: tokens are words carrying a leading space; a sequence's first space is dropped."""
    words = {1: " Hello", 2: " world", 3: "!", 4: " again"}
    return "".join(words[i] for i in ids).removeprefix(" ")


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    out = [detok.push([i]) for i in ids]
    out.append(detok.flush())
    return "".join(out)


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_detokenizer_byte_tokens_match_full_decode(text: str) -> None:
    ids = list(text.encode())
    detok = IncrementalDetokenizer(byte_decode)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    # Never emits a replacement character for a character that was merely incomplete.
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_holds_back_incomplete_character_then_releases() -> None:
    detok = IncrementalDetokenizer(byte_decode)
    raw = "é🎉".encode()
    assert detok.push([raw[0]]) == ""  # first byte of é
    assert detok.push([raw[1]]) == "é"
    assert [detok.push([b]) for b in raw[2:]] == ["", "", "", "🎉"]


def test_detokenizer_flushes_invalid_bytes_at_the_end() -> None:
    detok = IncrementalDetokenizer(byte_decode)
    assert detok.push(list(b"ok")) == "ok"
    assert detok.push([0xE4]) == ""  # a lone lead byte: could still complete
    assert detok.flush() == "\ufffd"  # generation ended: emit it as the full decode would


def test_detokenizer_context_keeps_leading_space() -> None:
    # Without context the first word loses its space, as the tokenizer would at sequence start;
    # with the prompt's last ids as context, the output keeps it.
    assert stream(IncrementalDetokenizer(sp_decode), [1, 2, 3]) == "Hello world!"
    assert stream(IncrementalDetokenizer(sp_decode, context_ids=[1]), [2, 3, 4]) == " world! again"


@given(st.text(min_size=0, max_size=60), st.lists(st.integers(1, 6), max_size=30))
@settings(max_examples=200, deadline=None)
def test_detokenizer_any_chunking_equals_full_decode(text: str, cuts: list[int]) -> None:
    ids = list(text.encode())
    detok = IncrementalDetokenizer(byte_decode)
    out, i = [], 0
    for c in cuts + [len(ids)]:
        out.append(detok.push(ids[i : i + c]))
        i += c
    out.append(detok.flush())
    assert "".join(out) == byte_decode(ids)


@pytest.fixture(scope="module")
def router_tok(smol_path) -> RouterTokenizer:
    return RouterTokenizer.from_dir(smol_path)


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_detokenizer_real_tokenizer_one_token_at_a_time(router_tok: RouterTokenizer, text: str) -> None:
    ids = router_tok.encode(text)
    detok = IncrementalDetokenizer(router_tok.decode)
    assert stream(detok, ids) == router_tok.decode(ids) == text


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
@settings(max_examples=60, deadline=None)
def test_detokenizer_real_tokenizer_property(router_tok: RouterTokenizer, text: str) -> None:
    ids = router_tok.encode(text)
    assert stream(IncrementalDetokenizer(router_tok.decode), ids) == router_tok.decode(ids)


def test_token_bytes_and_strings(router_tok: RouterTokenizer) -> None:
    ids = router_tok.encode("你好 🎉")
    assert b"".join(router_tok.token_bytes(i) for i in ids) == "你好 🎉".encode()
    # A token holding part of a character prints as escaped bytes, as OpenAI shows it.
    partial = [i for i in ids if not _decodes(router_tok.token_bytes(i))]
    assert partial and all(router_tok.token_str(i).startswith("bytes:\\x") for i in partial)


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode()
        return True
    except UnicodeDecodeError:
        return False


# ---- stop strings ------------------------------------------------------------------------------
def run_stop(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        out.append(m.push(p))
        if m.stopped:
            break
    if not m.stopped:
        out.append(m.flush())
    return "".join(out), m.stopped


def test_stop_across_token_boundaries() -> None:
    assert run_stop(["END"], ["Hello E", "N", "D and more"]) == ("Hello ", True)
    assert run_stop(["\n\n"], ["a\n", "\nb"]) == ("a", True)


def test_stop_partial_match_is_held_then_released() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == "abc "  # "ST" might begin STOP
    assert m.push("AR") == "STAR"  # it did not
    assert m.push("S") == ""
    assert m.flush() == "S"


def test_stop_earliest_of_several_wins() -> None:
    assert run_stop(["world", "lo"], ["Hello world"]) == ("Hel", True)
    assert run_stop(["xyz", "b"], ["a", "b", "c"]) == ("a", True)


def test_stop_multibyte_and_at_start() -> None:
    assert run_stop(["🎉"], ["ok ", "🎉", " after"]) == ("ok ", True)
    assert run_stop(["Hi"], ["Hi there"]) == ("", True)


@given(st.text(max_size=40), st.text(min_size=1, max_size=4), st.lists(st.integers(1, 5), max_size=20))
@settings(max_examples=300, deadline=None)
def test_stop_property(text: str, stop: str, cuts: list[int]) -> None:
    pieces, i = [], 0
    for c in cuts + [len(text)]:
        pieces.append(text[i : i + c])
        i += c
    out, stopped = run_stop([stop], pieces)
    k = text.find(stop)
    assert (out, stopped) == ((text[:k], True) if k != -1 else (text, False))


# ---- request validation (the app with no workers: everything here must fail before routing) -------
@pytest.fixture(scope="module")
def client(router_tok: RouterTokenizer, smol_path):
    from fastapi.testclient import TestClient

    from router.app import create_app

    info = ModelInfo.from_dir("smollm2-135m-instruct", smol_path)
    app = create_app(
        RouterConfig(api_key=None),
        RouterOptions(),
        tokenizer=router_tok,
        model_info=info,
        discovery=StaticDiscovery([], []),
        use_redis=False,
        http_limits=HttpLimits(max_body_bytes=64 * 1024),
    )
    with TestClient(app) as c:
        yield c


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def _post_json(client, path: str, body: dict):
    """Posts the body as JSON with non-ASCII escaped, as clients send it (a lone surrogate as \\ud800)."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def assert_error_answer(r, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The response is an OpenAI-shaped error of ``status`` (with ``param`` and ``code`` when given)."""
    assert r.status_code == status, r.text
    err = assert_openai_error(r.json())
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if status < 500 and status != 429 else err["type"])
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    "path,body,param",
    [
        (CHAT, {"messages": MSG, "temperature": 2.5}, "temperature"),
        (CHAT, {"messages": MSG, "temperature": "hot"}, "temperature"),
        (CHAT, {"messages": MSG, "top_p": 1.5}, "top_p"),
        (CHAT, {"messages": MSG, "n": 0}, "n"),
        (CHAT, {"messages": MSG, "n": 129}, "n"),
        (COMP, {"prompt": ["x"] * 9, "n": 128}, None),  # 1152 choices: more than one request may hold
        (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": MSG, "max_completion_tokens": -3}, "max_completion_tokens"),
        (CHAT, {"messages": MSG, "stop": [f"s{i}" for i in range(65)]}, "stop"),
        (CHAT, {"messages": MSG, "stop": [""]}, "stop"),
        (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"messages": MSG, "top_logprobs": 2}, None),
        (CHAT, {"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
        (CHAT, {"messages": MSG, "frequency_penalty": -2.5}, "frequency_penalty"),
        (CHAT, {"messages": MSG, "min_p": 2}, "min_p"),
        (CHAT, {"messages": MSG, "seed": 2**64}, "seed"),
        (CHAT, {"messages": MSG, "logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit to isdigit(), not to int()
        (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, None),
        (CHAT, {"messages": MSG, "continue_final_message": True}, None),  # with add_generation_prompt's default
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None),
        (COMP, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (COMP, {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo (the prompt alone)
        (COMP, {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        (CHAT, {"messages": MSG, "prompt_logprobs": 1, "stream": True}, None),  # as vLLM: not streamed
        (COMP, {"prompt": "x", "best_of": 3}, None),
        (COMP, {"prompt": []}, "prompt"),
        (COMP, {"prompt": [[1, 2], []]}, None),
        (COMP, {}, "prompt"),
        (COMP, {"prompt": [49152]}, "prompt"),
        (COMP, {"prompt": [-1]}, "prompt"),
        (COMP, {"prompt": ""}, "prompt"),
        (COMP, {"prompt": "x", "max_tokens": "lots"}, "max_tokens"),
    ],
)
def test_bad_parameters_are_400(client, path: str, body: dict, param: str | None) -> None:
    err = assert_error_answer(_post_json(client, path, body), 400)
    if param is not None:
        assert err["param"] == param


def test_bad_json_is_400_not_422(client) -> None:
    r = client.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert_error_answer(r, 400)
    r = client.post(CHAT, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert_error_answer(r, 400)
    # curl -d without a JSON Content-Type (it sends a form's type): the answer says what to send.
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    for content_type in ("application/x-www-form-urlencoded", None):
        headers = {"content-type": content_type} if content_type else {}
        err = assert_error_answer(client.post(CHAT, content=body, headers=headers), 400)
        assert "Content-Type: application/json" in err["message"], err
    err = assert_error_answer(client.post(CHAT, content=b"", headers={"content-type": "application/json"}), 400)
    assert "empty" in err["message"]


def _counts(client, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[tuple[str, str], ...], float] = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for sample in fam.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_every_rejected_request_is_counted_by_status(client) -> None:
    """kvferry_router_requests_total counts every response of the generation routes, those refused before
    or by validation included, and kvferry_router_http_requests_total counts every response by route."""
    requests_before = _counts(client, "kvferry_router_requests_total")
    http_before = _counts(client, "kvferry_router_http_requests_total")
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    bad: list[tuple[str, dict | bytes]] = [
        (CHAT, b"{not json"),
        (CHAT, {"temperature": 0}),
        (CHAT, {"messages": MSG, "temperature": 100}),
        (CHAT, {"messages": MSG, "n": 1000}),
        (CHAT, {"messages": MSG, "stop": [f"s{i}" for i in range(100)]}),
        (CHAT, {"messages": MSG, "use_beam_search": True}),
        (CHAT, {"messages": MSG, "response_format": schema}),
        (COMP, {"prompt": "x", "logprobs": 21}),
        (COMP, {"model": "gpt-7", "prompt": "x"}),
        (COMP, {"prompt": "x" * 70_000}),
    ]
    statuses = []
    for path, body in bad:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = client.post(path, json=body)
        assert r.status_code >= 400, (body, r.text)
        statuses.append(r.status_code)
    assert sorted(set(statuses)) == [400, 404, 413]
    requests_after = _counts(client, "kvferry_router_requests_total")
    http_after = _counts(client, "kvferry_router_http_requests_total")
    for status in set(statuses):
        key = (("outcome", "rejected"), ("status", str(status)))
        assert requests_after.get(key, 0) - requests_before.get(key, 0) == statuses.count(status), status
    for path in (CHAT, COMP):
        for status in set(statuses):
            key = (("method", "POST"), ("route", path), ("status", str(status)))
            sent = sum(1 for (p, _), st in zip(bad, statuses, strict=True) if p == path and st == status)
            assert http_after.get(key, 0) - http_before.get(key, 0) == sent, (path, status)
    client.get("/v1/nope/123")
    unmatched = (("method", "GET"), ("route", "unmatched"), ("status", "404"))
    assert _counts(client, "kvferry_router_http_requests_total")[unmatched] >= 1  # ids never become labels


def test_openapi_schema_advertises_the_statuses_the_router_answers(client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert "422" not in responses  # validation errors are answered 400, like OpenAI's API
        assert {"200", "400", "401", "413", "429", "503"} <= set(responses)
    assert not any("422" in op["responses"] for ops in paths.values() for op in ops.values())


def test_unknown_fields_are_ignored(client) -> None:
    # Valid apart from unknown fields: passes validation and reaches routing (503: no workers here).
    body = {"messages": MSG, "max_tokens": 4, "logit_bias": {"1": 2}, "user": "u", "tools": [], "frobnicate": 1}
    r = client.post(CHAT, json=body)
    err = assert_error_answer(r, 503)
    assert err["code"] == "service_unavailable"
    assert r.headers["retry-after"] == "1"  # a worker coming back (an engine restart) takes seconds


def test_requests_of_evaluation_suites_pass_validation(client) -> None:
    # lm-eval's humaneval stops on five sequences, plus the EOS text the harness adds (OpenAI allows 4, vLLM any);
    # pass@k samples n in the tens or hundreds (OpenAI allows up to 128).
    stops = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "<|im_end|>"]
    body = {"prompt": "def f():", "max_tokens": 4, "stop": stops, "n": 128, "temperature": 0.8}
    err = assert_error_answer(client.post(COMP, json=body), 503)
    assert err["code"] == "service_unavailable"  # past validation: refused only for want of a worker


def test_text_parts_of_a_message_are_joined_by_line_breaks() -> None:
    from router.surface.openai_api import ChatCompletionRequest

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    assert req.chat_messages() == [{"role": "user", "content": "Hello\nworld"}]


def test_unknown_model_is_404(client) -> None:
    assert_error_answer(client.post(CHAT, json={"model": "gpt-7", "messages": MSG}), 404, "model", "model_not_found")
    assert_error_answer(client.get("/v1/models/gpt-7"), 404, "model", "model_not_found")
    # A name that is no Unicode (JSON may carry a lone surrogate) is quoted back escaped, still a 404.
    err = assert_error_answer(_post_json(client, CHAT, {"model": "gpt\ud800", "messages": MSG}), 404, "model")
    assert "gpt\\ud800" in err["message"]
    assert client.get("/v1/models/smollm2-135m-instruct").json()["id"] == "smollm2-135m-instruct"


def test_context_length_is_checked_before_routing(client) -> None:
    # No worker is up, yet the answer is 400: the check needs none.
    r = client.post(COMP, json={"prompt": "hello", "max_tokens": 8192})
    assert_error_answer(r, 400, "prompt", "context_length_exceeded")
    long_chat = [{"role": "user", "content": "word " * 9000}]
    assert_error_answer(client.post(CHAT, json={"messages": long_chat}), 400, "messages", "context_length_exceeded")


def test_body_too_large_is_413(client) -> None:
    r = client.post(COMP, json={"prompt": "x" * 70_000})
    assert_error_answer(r, 413, code="request_too_large")


def test_no_worker_is_503_and_not_ready(client) -> None:
    assert_error_answer(client.post(COMP, json={"prompt": "hi", "max_tokens": 2}), 503)
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["workers"] == {"prefill": 0, "decode": 0, "mixed": 0}
    assert client.get("/health").status_code == 200


def test_models_and_unknown_route(client) -> None:
    data = client.get("/v1/models").json()
    assert data["object"] == "list" and data["data"][0]["id"] == "smollm2-135m-instruct"
    assert data["data"][0]["max_model_len"] == 8192  # vLLM's field: SmolLM2's context
    assert_error_answer(client.get("/v1/nope"), 404)
    assert_error_answer(client.get(CHAT), 405)


def test_auth_and_router_queue_limit(router_tok: RouterTokenizer, smol_path) -> None:
    from fastapi.testclient import TestClient

    from router.app import create_app

    info = ModelInfo.from_dir("smollm2-135m-instruct", smol_path)
    app = create_app(
        RouterConfig(api_key="sekret"),
        RouterOptions(max_inflight=0, retry_after_s=3),
        tokenizer=router_tok,
        model_info=info,
        discovery=StaticDiscovery([], []),
        use_redis=False,
    )
    with TestClient(app) as c:
        assert_error_answer(c.get("/v1/models"), 401, code="invalid_api_key")
        r = c.post(CHAT, json={"messages": MSG}, headers={"Authorization": "Bearer wrong"})
        assert_error_answer(r, 401)
        assert c.get("/health").status_code == 200  # probes need no key
        ok = {"Authorization": "Bearer sekret"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        r = c.post(CHAT, json={"messages": MSG}, headers=ok)
        err = assert_error_answer(r, 429)
        assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "3"


# ---- routing policy --------------------------------------------------------------------------------
BS = 16


def pf(key: str, queued: int = 0, inflight: int = 0) -> PrefillCandidate:
    return PrefillCandidate(key=key, pod=key, queued_tokens=queued, inflight_tokens=inflight)


def dc(key: str, running: int = 0, free: int = 1000, total: int = 1000) -> DecodeCandidate:
    return DecodeCandidate(key=key, pod=key, running=running, free_pages=free, total_pages=total, page_size=BS)


def test_prefix_wins_when_loads_are_close() -> None:
    policy = RoutingPolicy()
    prefill = [pf("p0", queued=300), pf("p1", queued=0)]
    # p0 holds 60 of the prompt's 64 blocks: 960 cached tokens outweigh its 300 queued ones.
    d = policy.choose(1024, 64, BS, prefill, [dc("d0")], {"p0": 60, "p1": 0, "d0": 0})
    assert d.prefill == "p0" and d.prefill_matched_tokens == 960 and d.reason == "disaggregated"


def test_imbalance_guard_stops_collapse_onto_the_warm_pod() -> None:
    policy = RoutingPolicy(PolicyConfig(imbalance_abs_tokens=2048, imbalance_ratio=1.5))
    matches = {"p0": 64, "p1": 0, "d0": 0}
    # The warm pod's queue is far beyond the cold one's: load wins although p0 holds the whole prefix.
    d = policy.choose(1024, 64, BS, [pf("p0", queued=9000), pf("p1", queued=100)], [dc("d0")], matches)
    assert d.prefill == "p1"
    # Same match, moderate imbalance (within the guard): the cache still wins.
    d = policy.choose(1024, 64, BS, [pf("p0", queued=1500), pf("p1", queued=100)], [dc("d0")], matches)
    assert d.prefill == "p0"


def test_router_inflight_counts_as_load() -> None:
    policy = RoutingPolicy()
    # /load says idle, but this router just sent p0 a lot of work: it counts.
    d = policy.choose(1024, 64, BS, [pf("p0", inflight=5000), pf("p1")], [dc("d0")], {"p0": 0, "p1": 0})
    assert d.prefill == "p1"


def test_short_prompt_and_decode_prefix_prefill_locally() -> None:
    policy = RoutingPolicy(PolicyConfig(disagg_min_prompt_tokens=256))
    prefill = [pf("p0")]
    d = policy.choose(100, 64, BS, prefill, [dc("d0")], {"p0": 0, "d0": 0})
    assert d.prefill is None and d.reason == "short-prompt"
    # Long prompt, but the decode pod already holds 90% of it: prefill there.
    d = policy.choose(2048, 64, BS, prefill, [dc("d0")], {"p0": 0, "d0": 116})
    assert d.prefill is None and d.reason == "decode-holds-prefix"
    d = policy.choose(2048, 64, BS, prefill, [dc("d0")], {"p0": 0, "d0": 10})
    assert d.prefill == "p0"
    d = policy.choose(2048, 64, BS, [], [dc("d0")], None)
    assert d.prefill is None and d.reason == "no-prefill"


def test_threshold_is_configurable() -> None:
    policy = RoutingPolicy(PolicyConfig(disagg_min_prompt_tokens=16))
    assert policy.choose(100, 8, BS, [pf("p0")], [dc("d0")], {}).prefill == "p0"


def test_redis_down_routes_on_load_only() -> None:
    policy = RoutingPolicy()
    prefill = [pf("p0", queued=400), pf("p1", queued=0)]
    with_index = policy.choose(1024, 64, BS, prefill, [dc("d0")], {"p0": 64, "p1": 0})
    assert with_index.prefill == "p0"
    without = policy.choose(1024, 64, BS, prefill, [dc("d0")], None)
    assert without.prefill == "p1" and without.prefill_matched_tokens == 0


def test_decode_by_free_pages_and_running() -> None:
    policy = RoutingPolicy()
    d = policy.choose(64, 64, BS, [], [dc("d0", running=5), dc("d1", running=1)], None)
    assert d.decode == "d1"
    # Equal running; d0 nearly out of KV pages.
    d = policy.choose(64, 64, BS, [], [dc("d0", running=2, free=50), dc("d1", running=2, free=900)], None)
    assert d.decode == "d1"
    # A pod that cannot hold prompt + max_tokens is skipped while another can.
    d = policy.choose(64, 4000, BS, [], [dc("d0", free=100), dc("d1", running=8, free=400)], None)
    assert d.decode == "d1"


def test_an_aggregated_fleet_picks_the_soonest_predicted_first_token() -> None:
    """No prefill pod: the decode pod picked prefills the prompt, so the one predicted to serve its first token
    soonest goes first, though it runs more requests (d1: a long prompt queued on d0); predictions equal to the
    millisecond fall back on the request count; with a prefill pod to take the prompt, the request count decides."""
    policy = RoutingPolicy()
    d0 = dc("d0", running=2)
    d0.predicted_ttft_s = 0.600  # few requests, a long prompt queued ahead
    d1 = dc("d1", running=6)
    d1.predicted_ttft_s = 0.150
    assert policy.choose(1024, 64, BS, [], [d0, d1], None).decode == "d1"
    d1.predicted_ttft_s = 0.6004
    assert policy.choose(1024, 64, BS, [], [d0, d1], None).decode == "d0"
    d1.predicted_ttft_s = 0.150
    d = policy.choose(1024, 64, BS, [pf("p0")], [d0, d1], None)
    assert d.decode == "d0" and d.prefill == "p0"
    d0.predicted_ttft_s = None  # a pod with nothing measured yet: the request count decides for all
    assert policy.choose(1024, 64, BS, [], [d0, d1], None).decode == "d0"


def test_ties_spread_round_robin() -> None:
    policy = RoutingPolicy()
    prefill = [pf("p0"), pf("p1"), pf("p2")]
    chosen = {policy.choose(1024, 16, BS, prefill, [dc("d0")], {}).prefill for _ in range(6)}
    assert chosen == {"p0", "p1", "p2"}


def test_recent_placements_match_and_expire() -> None:
    recent = RecentPlacements(ttl_s=5.0)
    recent.record("p0", [1, 2, 3], now=100.0)
    recent.record("p1", [1, 9], now=100.0)
    assert recent.match([1, 2, 3, 4], ["p0", "p1", "p2"], now=101.0) == {"p0": 3, "p1": 1, "p2": 0}
    assert recent.match([1, 2, 3], ["p0"], now=106.0) == {"p0": 0}


def test_round_robin_mode_ignores_prefix_and_load() -> None:
    policy = RoutingPolicy(PolicyConfig(mode="round_robin"))
    prefill = [pf("p0", queued=0), pf("p1", queued=9000)]
    picks = [policy.choose(1024, 16, BS, prefill, [dc("d0")], {"p0": 64}).prefill for _ in range(4)]
    assert picks == ["p0", "p1", "p0", "p1"]
    with pytest.raises(ValueError):
        RoutingPolicy(PolicyConfig(mode="random"))


# ---- prompts bounded before tokenizing ---------------------------------------------------------------------
PROSE = "The harbour pilot climbs aboard at dawn, reads the tide tables and names the berth. "


@pytest.mark.parametrize("text", [PROSE * 500, "word " * 40_000, "x" * 100_000, "\n" * 30_000 + PROSE * 300])
def test_bounded_encode_is_exact_at_the_limit(router_tok: RouterTokenizer, text: str) -> None:
    """Counting in pieces never refuses a text that fits: at exactly its own token count the ids are the
    unbounded ones; below it by more than the slack its cuts allow, it is refused."""
    ids = router_tok.encode(text, add_special_tokens=False)
    assert router_tok.encode(text, add_special_tokens=False, limit=len(ids)) == ids
    with pytest.raises(PromptTooLong):
        router_tok.encode(text, add_special_tokens=False, limit=len(ids) - 1 - 4 * (len(text) // 16384 + 1))


def test_bounded_encode_refuses_from_bytes_or_after_a_context_of_work(router_tok: RouterTokenizer) -> None:
    """A text whose bytes prove it longer than the limit is refused on that alone (at_least from the longest
    token); one whose bytes do not is refused once counting passes the limit, not at its full count."""
    huge = PROSE * 100_000  # ~8 MB: ~1.7 M tokens
    with pytest.raises(PromptTooLong) as refused:
        router_tok.encode(huge, limit=8192)
    assert refused.value.at_least == -(-len(huge.encode()) // router_tok.max_token_bytes) > 8192
    medium = PROSE * 4000  # ~340 KB: under what its bytes alone refuse at 8192 tokens, ~70 k tokens
    assert len(medium.encode()) // router_tok.max_token_bytes < 8192
    with pytest.raises(PromptTooLong) as refused:
        router_tok.encode(medium, limit=8192)
    assert refused.value.at_least == 8193
