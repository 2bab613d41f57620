"""The engine channel's typed messages (common/worker/messages.py) over a real pipe: every message survives
the wire as itself, a call's reply carries its result or its refusal, a turn's batch reaches the right
streams and handlers in order."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import msgspec
import pytest

from common.protocol import (
    GrammarSpec,
    HandshakeRequest,
    KVLayoutInfo,
    LoadSnapshot,
    PrefillRequest,
    SamplingParams,
    TokenLine,
    TokenLogprob,
)
from common.worker import messages as m
from common.worker.channel import EngineClient, EngineError, recv, send

LAYOUT = KVLayoutInfo(
    model_id="m", dtype="float32", page_size=16, num_layers=2, num_kv_heads=1, head_dim=8, layout_version=1
)
SAMPLING = SamplingParams(max_tokens=4, logit_bias={7: -100.0}, grammar=GrammarSpec(kind="regex", value="a+"))
HANDSHAKE = HandshakeRequest(
    agent_name="d", instance_id="i", agent_metadata_b64="bWV0YQ==", pool_info_b64="cG9vbA==", layout=LAYOUT
)
PREFILL = PrefillRequest(
    req_id="r", token_ids=(1, 2), sampling=SAMPLING, dst_agent="d", dst_instance_id="i", dst_pages=[3]
)
LOAD = LoadSnapshot(
    role="decode", pod="p", queued_prefill_tokens=0, running_requests=1, waiting_requests=0, free_pages=3,
    total_pages=8, page_size=16, ready=True, step_coefficients={"base_s": 0.01},
)  # fmt: skip
AGENT = m.AgentInfo("a", "i", "bWV0YQ==", "cG9vbA==", LAYOUT)
FIGURES = m.TransferFigures("decode-d", 4096, [(4096, 0.001)], 0.001, 0.0005, (1.0, 1.001))
LOGPROB = TokenLogprob(logprob=-0.5, top=[(1, -0.5), (2, -1.5)])

SAMPLES: list[m.Wire] = [
    m.PeerAdded("a", "i", LAYOUT),
    m.TransferCounts(1, {"writing": 1}, 3, 4096, 1),
    m.Stop(),
    m.Abort("r"),
    m.Abort("r", "error", "gone"),
    m.Generate("r", (1, 2, 3), SAMPLING, "prefill-p", "inst", 30.0, 1.5),
    m.PrefillFailed("r", "no progress"),
    m.PrefillSettled("r", "refused"),
    m.AddPeer(HANDSHAKE),
    m.Prefill(PREFILL, 2.0),
    m.Cancel("decode-d", "inst", ["r"]),
    m.Unanswered("r"),
    m.TransferStats(),
    m.Call(7, m.Generate("r", (1,), SamplingParams())),
    m.Reply(7, m.TransferCounts(0, {}, 0, 0, 0)),
    m.Reply(8, error="no", code="invalid_request"),
    m.Batch([m.Reply(9), m.Tokens("r", TokenLine(token_ids=[5], finish_reason="stop")), m.Load(LOAD)]),
    AGENT,
    m.Ready(AGENT, "pod-0"),
    m.Load(LOAD),
    m.Steps([0.01, 4.0]),
    m.KVIntegrity(2),
    m.Reserved("r1", [4, 5]),
    m.KVForcedRelease(1),
    m.Stopping("a tensor-parallel rank of this worker exited"),
    m.Tokens(
        "r",
        TokenLine(
            token_ids=[1, 2],
            logprobs=[LOGPROB, LOGPROB],
            prompt_tokens=3,
            timeline={"decode_received": 1.0},
            finish_reason="length",
        ),
    ),
    m.Tokens("r", TokenLine(finish_reason="error", error="engine process exited", retryable=True)),
    m.PrefillDone("r", 2, 16, {"prefill_received": 1.0}, FIGURES),
    m.PrefillError("r", "transfer failed"),
]


def _concrete(cls: type) -> set[type]:
    subs = set(cls.__subclasses__())
    return {c for c in subs if c not in (m.Command, m.Event, m.StreamEvent)} | {x for c in subs for x in _concrete(c)}


def _round_trip(msg: m.Wire) -> m.Wire:
    """Through the pipe's encoding; a reply's result and the engine's agent travel inside another message."""
    if isinstance(msg, m.PeerAdded | m.TransferCounts):
        reply = m.decode(m.encode(m.Reply(1, msg)))
        assert isinstance(reply, m.Reply) and reply.result is not None
        return reply.result
    if isinstance(msg, m.AgentInfo):
        ready = m.decode(m.encode(m.Ready(msg, "pod-0")))
        assert isinstance(ready, m.Ready)
        return ready.agent
    return m.decode(m.encode(msg))


def test_every_message_comes_off_the_wire_as_itself() -> None:
    for msg in SAMPLES:
        back = _round_trip(msg)
        assert back == msg and type(back) is type(msg), msg
    # Every message class has a sample here: a new one cannot join the channel untested.
    assert _concrete(m.Wire) == {type(s) for s in SAMPLES}


def test_payloads_travel_typed() -> None:
    """What the pod's edge validated is what the engine gets: structs, not dicts to validate again."""
    gen = m.decode(m.encode(m.Call(1, m.Generate("r", (1,), SAMPLING))))
    assert isinstance(gen, m.Call) and isinstance(gen.cmd, m.Generate)
    assert isinstance(gen.cmd.sampling, SamplingParams) and gen.cmd.sampling.logit_bias == {7: -100.0}
    assert isinstance(gen.cmd.sampling.grammar, GrammarSpec)
    prefill = m.decode(m.encode(m.Prefill(PREFILL)))
    assert isinstance(prefill, m.Prefill) and prefill.request == PREFILL


def test_an_int_past_64_bits_crosses_the_pipe() -> None:
    """The edge lets it through (a stop token id nothing samples); the engine must get it to refuse or ignore it."""
    big = m.Generate("r", (1,), SamplingParams(stop_token_ids=[2**70]))
    assert m.decode(m.encode(big)) == big


def test_what_is_not_a_message_is_refused_with_a_clear_error() -> None:
    for data in (
        msgspec.json.encode({"op": "generate", "req_id": "r"}),
        msgspec.json.encode({"_t": "Nope"}),
        msgspec.json.encode({"_t": "Stop", "extra": 1}),
        msgspec.json.encode({"_t": "Abort"}),
        msgspec.json.encode({"_t": "Generate", "req_id": "r", "token_ids": [1], "sampling": {"top_p": 2.0}}),
        b"{not json",
        b"",
    ):
        with pytest.raises(msgspec.DecodeError) as info:
            m.decode(data)
        assert str(info.value), data


def test_calls_casts_streams_and_events_over_a_pipe() -> None:
    async def run() -> None:
        ours, engine = mp.Pipe(duplex=True)
        events: list[m.Event] = []
        client = EngineClient(ours, asyncio.get_running_loop(), events.append)
        stream = client.open_stream("r")
        try:
            client.cast(m.Abort("x"))
            assert recv(engine) == m.Abort("x")  # a cast: the bare command, nothing to answer

            added = asyncio.ensure_future(client.call(m.AddPeer(HANDSHAKE)))
            call = await asyncio.to_thread(recv, engine)
            assert isinstance(call, m.Call) and call.cmd == m.AddPeer(HANDSHAKE)
            # One turn's batch: the reply, this stream's tokens, another request's (no stream: dropped), an event.
            turn = [
                m.Reply(call.rpc, m.PeerAdded("p", "i", LAYOUT)),
                m.Tokens("r", TokenLine(token_ids=[1])),
                m.Tokens("other", TokenLine(token_ids=[2])),
                m.KVForcedRelease(1),
            ]
            send(engine, m.Batch(turn))
            assert await asyncio.wait_for(added, 5) == m.PeerAdded("p", "i", LAYOUT)
            assert await asyncio.wait_for(stream.get(), 5) == m.Tokens("r", TokenLine(token_ids=[1]))
            assert stream.empty() and events == [m.KVForcedRelease(1)]

            refused = asyncio.ensure_future(client.call(m.Prefill(PREFILL)))
            call = await asyncio.to_thread(recv, engine)
            send(engine, m.Reply(call.rpc, error="no handshake", code="unknown_peer"))
            with pytest.raises(EngineError) as info:
                await asyncio.wait_for(refused, 5)
            assert info.value.code == "unknown_peer" and str(info.value) == "no handshake"
        finally:
            engine.close()
            ours.close()

    asyncio.run(run())
