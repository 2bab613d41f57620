"""Chained block hashing and the Redis prefix index, against a real redis-server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from common.prefix.hashing import chained_block_hashes, root_hash
from common.prefix.publisher import PrefixIndexPublisher
from common.prefix.reader import PrefixIndexReader
from common.prefix.scripts import IndexKeys, hash_hex
from tests.conftest_redis import (
    free_port,
    redis_server,  # noqa: F401
    start_redis,
    stop_redis,
)
from tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[1]
BS = 16

tokens_st = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=200)
block_st = st.integers(min_value=1, max_value=8)


def new_model() -> str:
    # Each test gets its own key namespace on the shared server instead of flushing it.
    return f"test-{uuid.uuid4().hex[:10]}"


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


class LoopReader:
    """The (asyncio) reader driven from plain test code: one event loop per reader, which its connections
    belong to, so the tests read like the router's calls without being coroutines themselves."""

    def __init__(self, url: str, model: str, **kw: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.reader = PrefixIndexReader(url, model, **kw)

    def match(self, hashes: list[int], pods: list[str]) -> dict[str, int] | None:
        return self.loop.run_until_complete(self.reader.match(hashes, pods))

    def live_pods(self) -> list[str] | None:
        return self.loop.run_until_complete(self.reader.live_pods())

    def close(self) -> None:
        self.loop.run_until_complete(self.reader.aclose())
        self.loop.close()


# ---------------------------------------------------------------------------------------------------
# hashing


def test_hash_matches_spec_and_golden_values() -> None:
    # Pinned values: a change here breaks routing across a rolling upgrade, so it must be deliberate.
    root = hashlib.blake2b(b"kvferry/prefix/v1" + bytes(8), digest_size=8).digest()
    h0 = hashlib.blake2b(root + struct.pack("<16i", *range(16)), digest_size=8).digest()
    h1 = hashlib.blake2b(h0 + struct.pack("<16i", *range(16, 32)), digest_size=8).digest()
    expected = [int.from_bytes(h0, "little"), int.from_bytes(h1, "little")]
    assert chained_block_hashes(toks(40), BS) == expected
    assert expected == [0xB936A364B17304FD, 0x29077AEAB52C4E91]
    assert root_hash(0) == int.from_bytes(root, "little")
    assert all(0 <= h < 2**64 for h in chained_block_hashes(toks(4096), BS))


def test_hash_deterministic_across_processes() -> None:
    code = (
        "import json; from common.prefix.hashing import chained_block_hashes as f; "
        "print(json.dumps([f(list(range(1000, 1300)), 16), f(list(range(77)), 4, seed=5)]))"
    )
    expected = [
        chained_block_hashes(toks(300, 1000), 16),
        chained_block_hashes(toks(77), 4, seed=5),
    ]
    for hashseed in ("1", "987654"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(REPO)}
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(out.stdout) == expected


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st, bs=block_st, cut=st.integers(min_value=0, max_value=200))
def test_prefix_of_tokens_gives_prefix_of_hashes(tokens: list[int], bs: int, cut: int) -> None:
    full = chained_block_hashes(tokens, bs)
    assert len(full) == len(tokens) // bs  # partial trailing block ignored
    assert chained_block_hashes(tokens[:cut], bs) == full[: min(cut, len(tokens)) // bs]


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st.filter(lambda t: len(t) >= 1), bs=block_st, data=st.data())
def test_changed_token_changes_its_block_and_all_later(tokens: list[int], bs: int, data: st.DataObject) -> None:
    i = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    changed = list(tokens)
    changed[i] = (changed[i] + 1) % 2**31
    a, b = chained_block_hashes(tokens, bs), chained_block_hashes(changed, bs)
    blk = i // bs
    assert a[:blk] == b[:blk]
    assert all(x != y for x, y in zip(a[blk:], b[blk:], strict=True))


def test_partial_block_parent_and_seed() -> None:
    t = toks(100)
    assert chained_block_hashes(t[:15], BS) == []
    assert chained_block_hashes(t[:47], BS) == chained_block_hashes(t[:32], BS)
    # Continuing a chain from its last hash equals hashing everything at once.
    head = chained_block_hashes(t[:32], BS)
    assert head + chained_block_hashes(t[32:96], BS, parent=head[-1]) == chained_block_hashes(t[:96], BS)
    # Another seed is another hash space; the same tokens at another position differ too.
    assert set(chained_block_hashes(t, BS, seed=1)).isdisjoint(chained_block_hashes(t, BS))
    assert chained_block_hashes(t[16:32], BS) != chained_block_hashes(t[:32], BS)[1:]
    with pytest.raises(ValueError):
        chained_block_hashes(t, 0)


# ---------------------------------------------------------------------------------------------------
# index


@pytest.fixture
def model() -> str:
    return new_model()


@pytest.fixture
def url(redis_server: str) -> str:  # noqa: F811 - the fixture imported from conftest_redis
    return redis_server


@pytest.fixture
def make_pub(url: str, model: str) -> Iterator[Callable[..., PrefixIndexPublisher]]:
    """Factory for started publishers on the shared server, all stopped at the end of the test."""
    started: list[PrefixIndexPublisher] = []

    def make(pod: str, **kw: object) -> PrefixIndexPublisher:
        kw.setdefault("flush_interval_s", 0.01)
        pub = PrefixIndexPublisher(url, model, pod, **kw)  # type: ignore[arg-type]
        pub.start()
        started.append(pub)
        return pub

    yield make
    for pub in started:
        pub.stop()


@pytest.fixture
def reader(url: str, model: str) -> Iterator[LoopReader]:
    r = LoopReader(url, model)
    yield r
    r.close()


def test_match_counts_leading_blocks_per_pod(make_pub, reader: LoopReader) -> None:
    hashes = chained_block_hashes(toks(160), BS)  # 10 blocks
    a, b = make_pub("pod-a"), make_pub("pod-b")
    a.stored(hashes[:7])
    b.stored(hashes[:3])
    b.stored(hashes[5:9])  # held, but not reachable past b's miss at block 3
    assert a.wait_idle() and b.wait_idle()
    assert reader.match(hashes, ["pod-a", "pod-b", "pod-c"]) == {
        "pod-a": 7,
        "pod-b": 3,
        "pod-c": 0,
    }
    assert reader.match(hashes[:2], ["pod-b", "pod-a"]) == {"pod-b": 2, "pod-a": 2}

    a.removed(hashes[4:7])
    a.removed([hashes[1]])
    assert a.wait_idle()
    assert reader.match(hashes, ["pod-a", "pod-b"]) == {"pod-a": 1, "pod-b": 3}
    # Stored then removed within one flush interval: net effect nothing.
    b.stored([hashes[3]])
    b.removed([hashes[3]])
    assert b.wait_idle()
    assert reader.match(hashes, ["pod-b"]) == {"pod-b": 3}
    assert reader.match([], ["pod-a"]) == {"pod-a": 0}
    assert reader.match(hashes, []) == {}
    assert reader.live_pods() == ["pod-a", "pod-b"]


def test_key_layout(make_pub, url: str, model: str) -> None:
    hashes = chained_block_hashes(toks(48), BS)
    pub = make_pub("pod-a")
    pub.stored(hashes)
    assert pub.wait_idle()
    r = redis.Redis.from_url(url, decode_responses=True)
    k = IndexKeys(model)
    assert r.smembers(f"kvf:{model}:blk:{hashes[0]:016x}") == {"pod-a"}
    assert r.smembers(f"kvf:{model}:pod:pod-a:blocks") == {hash_hex(h) for h in hashes}
    assert 0 < r.pttl(f"kvf:{model}:hb:pod-a") <= 10_000
    assert k.block(hashes[0]) == f"kvf:{model}:blk:{hashes[0]:016x}"
    r.close()


def test_heartbeat_expiry_counts_zero(make_pub, reader: LoopReader, url: str, model: str) -> None:
    hashes = chained_block_hashes(toks(64), BS)
    pub = make_pub("pod-a", heartbeat_s=0.1, ttl_s=0.4)
    pub.stored(hashes)
    assert pub.wait_idle()
    assert reader.match(hashes, ["pod-a"]) == {"pod-a": 4}
    # Heartbeats keep it alive past the TTL while running: Redis's own clock passes the expiry the heartbeat
    # key had at first, and the entries still count.
    r = redis.Redis.from_url(url)
    first_expiry_ms = r.pexpiretime(IndexKeys(model).heartbeat("pod-a"))
    assert first_expiry_ms > 0
    wait_until(lambda: redis_clock_ms(r) > first_expiry_ms, 3.0, "the first heartbeat's TTL to run out")
    r.close()
    assert reader.match(hashes, ["pod-a"]) == {"pod-a": 4}
    pub.stop(deregister=False)  # a crash: entries stay, heartbeat stops
    wait_until(lambda: reader.match(hashes, ["pod-a"]) == {"pod-a": 0}, 3.0, "heartbeat expiry")
    assert reader.live_pods() == []


def redis_clock_ms(r: redis.Redis) -> int:
    """Redis's clock, the one its TTLs run on, in ms since the epoch."""
    secs, micros = r.time()
    return secs * 1000 + micros // 1000


def test_restarted_publisher_replaces_old_entries(make_pub, reader: LoopReader) -> None:
    old = chained_block_hashes(toks(64, 5000), BS)
    new = chained_block_hashes(toks(64, 9000), BS)
    first = make_pub("pod-a")
    first.stored(old)
    assert first.wait_idle()
    first.stop(deregister=False)
    second = make_pub("pod-a", resync=lambda: new[:2])
    assert second.wait_idle()
    assert reader.match(old, ["pod-a"]) == {"pod-a": 0}
    assert reader.match(new, ["pod-a"]) == {"pod-a": 2}


def test_events_before_start_and_buffer_overflow(
    reader: LoopReader, url: str, model: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvferry.prefix")
    hashes = chained_block_hashes(toks(160), BS)
    # Pushed before start(): buffered and published by the first flush.
    early = PrefixIndexPublisher(url, model, "pod-a", flush_interval_s=0.01)
    early.stored(hashes[:3])
    early.start()
    try:
        assert early.wait_idle()
        assert reader.match(hashes, ["pod-a"]) == {"pod-a": 3}
    finally:
        early.stop()
    # More events than the buffer bound: dropped, then rebuilt from resync().
    cache = hashes[:9]
    pub = PrefixIndexPublisher(url, model, "pod-b", flush_interval_s=0.01, resync=lambda: cache, max_buffered_hashes=4)
    for h in cache:
        pub.stored([h])
    pub.start()
    try:
        assert pub.wait_idle()
        assert reader.match(hashes, ["pod-b"]) == {"pod-b": 9}
    finally:
        pub.stop()
    assert any("overflowed" in rec.getMessage() for rec in caplog.records)


def test_graceful_stop_deregisters(make_pub, reader: LoopReader, url: str, model: str) -> None:
    hashes = chained_block_hashes(toks(64), BS)
    pub = make_pub("pod-a")
    pub.stored(hashes)
    assert pub.wait_idle()
    pub.stop(deregister=True)
    pub.stored(hashes)  # after stop: a no-op, not an error
    assert reader.match(hashes, ["pod-a"]) == {"pod-a": 0}
    r = redis.Redis.from_url(url)
    assert r.keys(f"kvf:{model}:*") == []
    r.close()


def test_dead_pod_leftovers_are_collected(make_pub, url: str, model: str) -> None:
    hashes = chained_block_hashes(toks(64), BS)
    dead = make_pub("pod-dead", heartbeat_s=0.1, ttl_s=0.3)
    dead.stored(hashes)
    assert dead.wait_idle()
    dead.stop(deregister=False)
    survivor = make_pub("pod-b", gc_interval_s=0.1)
    survivor.stored(hashes[:1])
    r = redis.Redis.from_url(url, decode_responses=True)
    wait_until(
        lambda: not r.exists(f"kvf:{model}:pod:pod-dead:blocks"),
        3.0,
        "garbage collection",
    )
    assert r.smembers(f"kvf:{model}:pods") == {"pod-b"}
    assert r.smembers(f"kvf:{model}:blk:{hash_hex(hashes[0])}") == {"pod-b"}
    assert not r.exists(f"kvf:{model}:blk:{hash_hex(hashes[1])}")
    r.close()


def test_vanished_keys_trigger_resync(make_pub, reader: LoopReader, url: str, model: str) -> None:
    # Redis restarted or flushed without the publisher seeing a connection error: the heartbeat's
    # SET ... GET returns nothing and the publisher rebuilds its entries from the cache.
    hashes = chained_block_hashes(toks(64), BS)
    cache = set(hashes)
    pub = make_pub("pod-a", heartbeat_s=0.1, resync=lambda: list(cache))
    assert pub.wait_idle()
    assert reader.match(hashes, ["pod-a"]) == {"pod-a": 4}
    r = redis.Redis.from_url(url)
    r.delete(*r.keys(f"kvf:{model}:*"))
    r.close()
    assert reader.match(hashes, ["pod-a"]) == {"pod-a": 0}
    wait_until(lambda: reader.match(hashes, ["pod-a"]) == {"pod-a": 4}, 3.0, "resync")


def test_redis_outage_and_recovery(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvferry.prefix")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = start_redis(port)
    model = new_model()
    hashes = chained_block_hashes(toks(160), BS)
    cache: set[int] = set()

    def cache_store(hs: list[int]) -> None:
        cache.update(hs)
        pub.stored(hs)

    pub = PrefixIndexPublisher(
        url,
        model,
        "pod-a",
        heartbeat_s=0.1,
        ttl_s=1.0,
        flush_interval_s=0.01,
        resync=lambda: list(cache),
        max_backoff_s=0.2,
    )
    reader = LoopReader(url, model, max_backoff_s=0.2)
    pub.start()
    try:
        cache_store(hashes[:4])
        assert pub.wait_idle()
        assert reader.match(hashes, ["pod-a"]) == {"pod-a": 4}

        stop_redis(proc)
        t0 = time.perf_counter()
        assert reader.match(hashes, ["pod-a"]) is None
        assert reader.live_pods() is None
        assert time.perf_counter() - t0 < 0.5
        # The scheduler keeps going: calls neither raise nor block while the thread fails and backs off.
        t0 = time.perf_counter()
        for _ in range(2000):
            cache_store(hashes[4:8])
        assert time.perf_counter() - t0 < 0.5
        # The publisher's thread tried to write those with Redis gone, and said so.
        wait_until(lambda: published_outage(caplog), 3.0, "the publisher to find Redis gone")
        assert reader.match(hashes, ["pod-a"]) is None
        assert not pub.wait_idle(0.1)

        proc = start_redis(port)  # same port, empty: nothing survived
        wait_until(
            lambda: reader.match(hashes, ["pod-a"]) == {"pod-a": 8},
            5.0,
            "resync after restart",
        )
        assert reader.live_pods() == ["pod-a"]
        pub.removed(hashes[6:])
        cache.difference_update(hashes[6:])
        assert pub.wait_idle()
        assert reader.match(hashes, ["pod-a"]) == {"pod-a": 6}
    finally:
        pub.stop()
        reader.close()
        stop_redis(proc)
    msgs = _prefix_messages(caplog)
    assert sum("unavailable" in m for m in msgs if "publisher" in m) == 1, msgs
    assert sum("unavailable" in m for m in msgs if "reader" in m) == 1, msgs
    assert sum("recovered" in m for m in msgs if "publisher" in m) == 1, msgs
    assert sum("recovered" in m for m in msgs if "reader" in m) == 1, msgs


def published_outage(caplog: pytest.LogCaptureFixture) -> bool:
    return any("publisher" in m and "unavailable" in m for m in _prefix_messages(caplog))


def _prefix_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [rec.getMessage() for rec in caplog.records if rec.name == "kvferry.prefix"]


def _monitor_lines(sock: socket.socket) -> list[str]:
    sock.settimeout(0.3)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return [ln for ln in data.decode().split("\r\n") if ln.startswith("+") and ln != "+OK"]


def test_match_is_one_round_trip_via_script() -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = start_redis(port)
    model = new_model()
    hashes = chained_block_hashes(toks(64 * BS), BS)  # 64 blocks
    pubs = [PrefixIndexPublisher(url, model, f"pod-{i}", ttl_s=60.0, flush_interval_s=0.01) for i in range(3)]
    reader = LoopReader(url, model)
    admin = redis.Redis(host="127.0.0.1", port=port)
    mon = socket.create_connection(("127.0.0.1", port))
    try:
        for i, pub in enumerate(pubs):
            pub.start()
            pub.stored(hashes[: 20 * (i + 1)])
            assert pub.wait_idle()
            pub.stop(deregister=False)  # no background traffic during the measurement
        pods = ["pod-0", "pod-1", "pod-2", "pod-x"]
        want = {"pod-0": 20, "pod-1": 40, "pod-2": 60, "pod-x": 0}
        # Warm-up: connection setup (CLIENT SETINFO) and the script load on a fresh server.
        assert reader.match(hashes, pods) == want
        evalsha_before = admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        mon.sendall(b"MONITOR\r\n")
        assert mon.recv(16).startswith(b"+OK")
        for _ in range(5):
            assert reader.match(hashes, pods) == want
        lines = _monitor_lines(mon)
        stats = admin.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] - evalsha_before == 5
        client_cmds = [ln.split('"')[1].lower() for ln in lines if " lua]" not in ln]
        assert client_cmds == ["evalsha"] * 5, client_cmds
        # The walk stops once every pod missed: block 61 is never looked at.
        script_cmds = [ln for ln in lines if " lua]" in ln]
        assert not any(hash_hex(hashes[61]) in ln for ln in script_cmds)
    finally:
        mon.close()
        admin.close()
        reader.close()
        stop_redis(proc)
