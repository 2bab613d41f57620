"""The wire's schema (common/protocol.py): every message between kvferry processes survives JSON as itself, and
what is not one is a clear DecodeError (what is wrong, and where), never a crash; the token line the decode
worker writes is the one the router reads. The engine pipe's messages: tests/test_channel.py."""

from __future__ import annotations

import json

import msgspec
import pytest

from common import protocol
from common.protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    CancelTransfers,
    DecodeError,
    GenerateRequest,
    GrammarSpec,
    HandshakeRequest,
    HandshakeResponse,
    KVLayoutInfo,
    KVNotice,
    LoadSnapshot,
    PrefillProgress,
    PrefillRequest,
    PromptLogprobs,
    SamplingParams,
    Schema,
    TokenLine,
    TokenLogprob,
    Versioned,
    convert,
    decode,
    encode,
    foreign_version,
    to_builtins,
)

LAYOUT = KVLayoutInfo(
    model_id="m", dtype="bfloat16", page_size=16, num_layers=2, num_kv_heads=1, head_dim=8, layout_version=1
)
SAMPLING = SamplingParams(
    max_tokens=4,
    temperature=0.7,
    seed=-3,
    stop_token_ids=[2],
    logprobs=True,
    top_logprobs=2,
    logit_bias={7: -100.0, 9: 2.5},
    grammar=GrammarSpec(kind="json_schema", value='{"type": "object"}'),
    output_offset=1,
    slo_class="interactive",
)
LOGPROB = TokenLogprob(logprob=-0.25, top=[(5, -0.25), (6, -2.0)])

SAMPLES: list[msgspec.Struct] = [
    SAMPLING,
    SamplingParams(),
    GrammarSpec(kind="json_object"),
    LOGPROB,
    GenerateRequest(req_id="r", token_ids=(1, 2, 3), sampling=SAMPLING, prefill_url="http://p:8100", kv_timeout_s=9.0),
    GenerateRequest(req_id="r", token_ids=(1,), sampling=SamplingParams()),
    TokenLine(token_ids=[5]),
    TokenLine(
        token_ids=[5, 6],
        logprobs=[LOGPROB, LOGPROB],
        prompt_tokens=3,
        cached_tokens=1,
        timeline={"decode_received": 1.5},
        kv_verified=True,
    ),
    TokenLine(finish_reason="error", error="engine process exited", retryable=True, overloaded=True),
    LAYOUT,
    KVLayoutInfo(**{**to_builtins(LAYOUT), "tp_size": 2, "kv_scales": [1.0, 0.5]}),
    HandshakeRequest(agent_name="d", instance_id="i", agent_metadata_b64="bQ==", pool_info_b64="cA==", layout=LAYOUT),
    HandshakeResponse(agent_name="p", instance_id="j", layout=LAYOUT),
    PrefillRequest(
        req_id="r", token_ids=(1, 2), sampling=SAMPLING, dst_agent="d", dst_instance_id="i", dst_pages=[4], deadline_s=5
    ),
    KVNotice(req_id="r", outcome="landed", token=3, logprob=LOGPROB, cached_tokens=16, checksums=[1.0], timeline={}),
    KVNotice(req_id="r", outcome="closed", error="cancelled"),
    KVNotice(
        req_id="r",
        outcome="landed",
        token=3,
        prompt_logprobs=PromptLogprobs(
            logprobs=[-0.5, -2.25], ranks=[1, 7], top_ids=[[4, 9], [8, 2]], top_logprobs=[[-0.5, -1.0], [-0.75, -1.5]]
        ),
    ),
    TokenLine(token_ids=[5], prompt_logprobs=PromptLogprobs(logprobs=[-1.0], ranks=[2])),
    PromptLogprobs(logprobs=[-1.0, -0.125], ranks=[2, 1]),
    PrefillProgress(heartbeat=True),
    PrefillProgress(req_id="r", done=True, descs=2, cached_tokens=16),
    PrefillProgress(req_id="r", error="gone", engine_exited=True),
    AbortRequest(req_id="r"),
    CancelTransfers(dst_agent="d", dst_instance_id="i", req_ids=["a", "b"]),
    LoadSnapshot(
        role="mixed",
        pod="pod-0",
        queued_prefill_tokens=5,
        running_requests=1,
        waiting_requests=2,
        free_pages=3,
        total_pages=8,
        page_size=16,
        ready=True,
        step_coefficients={"base_s": 0.004},
        queued_ahead_tokens={"interactive": 12},
    ),
]


def test_every_message_comes_off_the_wire_as_itself() -> None:
    for msg in SAMPLES:
        data = encode(msg)
        json.loads(data)  # plain JSON, readable by anything
        assert decode(data, type(msg)) == msg, msg
    # Every struct of the schema has a sample here: a new one cannot join the wire untested.
    structs = {
        v
        for name, v in vars(protocol).items()
        if isinstance(v, type) and issubclass(v, msgspec.Struct) and v.__module__ == protocol.__name__
        if not name.startswith("_")
    }
    assert structs - {type(s) for s in SAMPLES} == {Schema, Versioned}  # the bases


def test_every_http_body_says_its_version_and_a_foreign_one_is_refused() -> None:
    body = json.loads(encode(AbortRequest(req_id="r")))
    assert body == {"req_id": "r", "protocol_version": PROTOCOL_VERSION}
    with pytest.raises(DecodeError, match="unsupported protocol_version 2"):
        decode(b'{"req_id": "r", "protocol_version": 2}', AbortRequest)
    # A newer version's body may fail on its fields first: the version is what a worker says it refused.
    assert foreign_version(b'{"protocol_version": 2, "req_id": "r"}') == (
        f"unsupported protocol_version 2; this worker speaks {PROTOCOL_VERSION}"
    )
    for same_or_unreadable in (b'{"protocol_version": 1}', b"{}", b'{"protocol_version": "one"}', b"[", b"\xff"):
        assert foreign_version(same_or_unreadable) is None


def test_a_token_line_carries_only_what_is_set() -> None:
    """The decode worker's lines are short: defaults stay off the wire, and the router reads them back."""
    assert encode(TokenLine(token_ids=[3])) == b'{"token_ids":[3]}'
    assert json.loads(encode(TokenLine(finish_reason="stop"))) == {"finish_reason": "stop"}
    back = decode(b'{"token_ids":[3],"a_field_from_a_newer_worker":1}', TokenLine)
    assert back == TokenLine(token_ids=[3]) and back.prompt_tokens == 0 and back.retryable is False


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b"", "truncated"),
        (b"{not json", "malformed"),
        (b'{"token_ids": "12"}', "$.token_ids"),
        (b'{"token_ids": [1.5]}', "$.token_ids[0]"),
        (b'{"finish_reason": "exploded"}', "$.finish_reason"),
        (b'{"logprobs": [{"top": []}]}', "logprob"),
        (b'["token_ids"]', "Expected `object`"),
        (b'{"error": "\xff"}', "malformed"),
        (b"[" * 10000, "Expected `object`"),
    ],
)
def test_a_malformed_token_line_is_a_clear_error(line: bytes, says: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode(line, TokenLine)
    assert says in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"req_id": "", "token_ids": [1], "sampling": {}}, "$.req_id"),
        ({"req_id": "r", "token_ids": [], "sampling": {}}, "$.token_ids"),
        ({"req_id": "r", "token_ids": [1], "sampling": {"top_p": 0}}, "$.sampling.top_p"),
        ({"req_id": "r", "token_ids": [1], "sampling": {"top_logprobs": 21}}, "$.sampling.top_logprobs"),
        ({"req_id": "r", "token_ids": [1], "sampling": {"logit_bias": {"1": 101}}}, "outside [-100, 100]"),
        ({"req_id": "r", "token_ids": [1], "sampling": {"logit_bias": {"-1": 1}}}, "negative"),
        ({"req_id": "r", "token_ids": [1], "sampling": {"output_offset": 1}}, "shorter than the prompt"),
        ({"req_id": "r", "token_ids": [1], "sampling": {"grammar": {"kind": "lark"}}}, "$.sampling.grammar.kind"),
        ({"req_id": "r", "token_ids": [1], "sampling": {}, "extra": 1}, "unknown field `extra`"),
        ({"req_id": "r", "token_ids": [1]}, "missing required field `sampling`"),
        ({"req_id": "r", "token_ids": [1], "sampling": {}, "kv_timeout_s": 0}, "$.kv_timeout_s"),
    ],
)
def test_a_bad_generate_request_names_what_is_wrong(body: dict, says: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode(json.dumps(body).encode(), GenerateRequest)
    assert says in str(info.value), str(info.value)


def test_a_notice_that_landed_carries_its_first_token() -> None:
    with pytest.raises(DecodeError, match="carries the first token"):
        convert({"req_id": "r", "outcome": "landed"}, KVNotice)
    with pytest.raises(DecodeError, match="4000"):
        convert({"req_id": "r", "outcome": "closed", "error": "x" * 4001}, KVNotice)
