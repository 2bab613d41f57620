"""The engine channel's typed messages (common/serving/messages.py) over a real pipe: every message survives
the wire as itself, a call's reply carries its result or its refusal, a turn's batch reaches the right
streams and handlers in order."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp

import pytest

from common.serving import messages as m
from common.serving.channel import EngineClient, EngineError, recv, send

SAMPLES: list[m.Wire] = [
    m.PeerAdded("a", "i", {"page_size": 16}),
    m.TransferCounts(1, {"writing": 1}, 3, 4096, 1),
    m.Stop(),
    m.Abort("r"),
    m.Abort("r", "error", "gone"),
    m.Generate("r", [1, 2, 3], {"max_tokens": 4}, "prefill-p", "inst", 30.0, 1.5),
    m.PrefillFailed("r", "no progress"),
    m.PrefillSettled("r", "refused"),
    m.AddPeer({"agent_name": "d"}),
    m.Prefill({"req_id": "r"}, 2.0),
    m.Cancel("decode-d", "inst", ["r"]),
    m.Unanswered("r"),
    m.TransferStats(),
    m.Call(7, m.Generate("r", [1], {})),
    m.Reply(7, m.TransferCounts(0, {}, 0, 0, 0)),
    m.Reply(8, error="no", code="invalid_request"),
    m.Batch([m.Reply(9), m.Tokens("r", [5], finish_reason="stop"), m.Load({"pod": "p"})]),
    m.AgentInfo("a", "i", "bWV0YQ==", "cG9vbA==", {"page_size": 16}),
    m.Ready(m.AgentInfo("a", "i", "bWV0YQ==", "cG9vbA==", {}), "pod-0"),
    m.Load({"pod": "p", "free_pages": 3}),
    m.Steps([0.01, 4.0]),
    m.KVIntegrity(2),
    m.Reserved("r1", [4, 5]),
    m.KVForcedRelease(1),
    m.Tokens("r", [1, 2], [{"token": 1, "logprob": -0.5, "top": []}], 3, 0, {"decode_received": 1.0}, "length"),
    m.Tokens("r", [], finish_reason="error", error="engine process exited", retryable=True),
    m.PrefillDone("r", 2, 16, {"prefill_received": 1.0}, {"peer": "decode-d"}),
    m.PrefillError("r", "transfer failed"),
]


def test_every_message_comes_off_the_wire_as_itself() -> None:
    for msg in SAMPLES:
        assert m.decode(m.encode(msg)) == msg, msg
    # Every message class has a sample here: a new one cannot join the channel untested.
    concrete = {c for c in m.Wire.registry.values() if dataclasses.is_dataclass(c)}
    assert concrete == {type(s) for s in SAMPLES}


def test_what_is_not_a_message_is_refused() -> None:
    for data in (b'{"op": "generate", "req_id": "r"}', b'{"_t": "Nope"}', b'{"_t": "Stop", "extra": 1}'):
        with pytest.raises((ValueError, TypeError)):
            m.decode(data)


def test_a_stream_line_carries_what_the_event_says_and_nothing_else() -> None:
    assert m.Tokens("r", [3], cached_tokens=0, kv_verified=True).stream_item() == {
        "token_ids": [3],
        "cached_tokens": 0,
        "kv_verified": True,
    }


def test_calls_casts_streams_and_events_over_a_pipe() -> None:
    async def run() -> None:
        ours, engine = mp.Pipe(duplex=True)
        events: list[m.Event] = []
        client = EngineClient(ours, asyncio.get_running_loop(), events.append)
        stream = client.open_stream("r")
        try:
            client.cast(m.Abort("x"))
            assert recv(engine) == m.Abort("x")  # a cast: the bare command, nothing to answer

            added = asyncio.ensure_future(client.call(m.AddPeer({"agent_name": "d"})))
            call = await asyncio.to_thread(recv, engine)
            assert isinstance(call, m.Call) and call.cmd == m.AddPeer({"agent_name": "d"})
            # One turn's batch: the reply, this stream's tokens, another request's (no stream: dropped), an event.
            turn = [
                m.Reply(call.rpc, m.PeerAdded("p", "i", {})),
                m.Tokens("r", [1]),
                m.Tokens("other", [2]),
                m.KVForcedRelease(1),
            ]
            send(engine, m.Batch(turn))
            assert await asyncio.wait_for(added, 5) == m.PeerAdded("p", "i", {})
            assert await asyncio.wait_for(stream.get(), 5) == m.Tokens("r", [1])
            assert stream.empty() and events == [m.KVForcedRelease(1)]

            refused = asyncio.ensure_future(client.call(m.Prefill({"req_id": "r"})))
            call = await asyncio.to_thread(recv, engine)
            send(engine, m.Reply(call.rpc, error="no handshake", code="unknown_peer"))
            with pytest.raises(EngineError) as info:
                await asyncio.wait_for(refused, 5)
            assert info.value.code == "unknown_peer" and str(info.value) == "no handshake"
        finally:
            engine.close()
            ours.close()

    asyncio.run(run())
