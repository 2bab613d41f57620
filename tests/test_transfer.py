"""KV transfer over real NIXL (UCX, CPU DRAM) between real processes.

The sender (prefill) and receiver (decode) each run in their own spawned process, as in production:
UCX picks shared-memory transports between processes, and NIXL in one process behaves differently.
Handshakes cross process boundaries only as str/bytes through queues, the way they cross HTTP.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Any

import pytest
import torch

from common.kv.pool import KVLayout, KVPool
from common.protocol import KVLayoutInfo, decode, encode, replace
from common.transfer.agent import KVTransferAgent, PeerError
from common.transfer.descs import PoolInfo, page_runs, pool_infos_from_b64, pool_infos_to_b64, run_descs
from common.transfer.layout import LAYOUT_VERSION, LayoutMismatch, check_compatible, layout_info
from common.transfer.session import IllegalMove, S, TransferSession

MODEL = "test-model"
NUM_LAYERS = 4
NUM_PAGES = 64
STEP_TIMEOUT_S = 30.0

# A known pattern, three chunks: breaks where src jumps, where dst jumps, and where dst runs backwards.
CHUNKS: list[tuple[list[int], list[int]]] = [
    ([2, 3, 4, 5, 9, 10], [7, 8, 9, 10, 11, 12]),  # runs 2->7 x4, 9->11 x2
    ([11, 12, 13, 14], [20, 21, 30, 31]),  # runs 11->20 x2, 13->30 x2
    ([40, 41, 42, 43, 50, 60, 61], [50, 51, 52, 53, 54, 5, 4]),  # runs x4, x1, x1, x1
]
CHUNK_RUNS = [2, 2, 4]


def _layout(
    head_dim: int = 16, page_size: int = 16, dtype: torch.dtype = torch.float32, kv_scales: tuple[float, ...] = ()
) -> KVLayout:
    return KVLayout(NUM_LAYERS, 2, head_dim, page_size, dtype, kv_scales)


def _handshake(agent: KVTransferAgent) -> dict[str, str]:
    """What a decode worker would put in its HandshakeRequest: strings only."""
    return {
        "agent_name": agent.name,
        "instance_id": agent.instance_id,
        "metadata_b64": agent.metadata_b64(),
        "pool_info_b64": agent.pool_info_b64(),
        "layout": encode(agent.layout).decode(),
    }


def _add_peer(agent: KVTransferAgent, hs: dict[str, str]) -> None:
    agent.add_peer(
        hs["agent_name"],
        hs["instance_id"],
        hs["metadata_b64"],
        hs["pool_info_b64"],
        decode(hs["layout"], KVLayoutInfo),
    )


# -- child processes (top level so the spawn context can import them) ---------------------------------


def _receiver_main(name: str, cmd_q: Any, out_q: Any) -> None:
    from common.transfer.receiver import KVReceiver

    pool = KVPool(_layout(), NUM_PAGES)
    agent = KVTransferAgent(name, pool, model_id=MODEL)
    receiver = KVReceiver(agent)
    out_q.put(("hello", _handshake(agent)))
    while True:
        cmd = cmd_q.get(timeout=120)
        if cmd[0] == "stop":
            break
        if cmd[0] == "expect":
            # Poll until the first notification, checksum the pages right then (the data must already be
            # there), then keep polling a while so a duplicate notification would be seen.
            _, pages, timeout_s, linger_s = cmd
            pages_t = torch.tensor(pages)
            got: list[tuple[str, bytes]] = []
            sums_at_notif: list[float] | None = None
            end = time.monotonic() + timeout_s
            while time.monotonic() < end:
                for item in receiver.poll_notifications():
                    got.append(item)
                    if sums_at_notif is None:
                        sums_at_notif = pool.page_checksums(pages_t).tolist()
                        end = min(end, time.monotonic() + linger_s)
                time.sleep(0.001)
            out_q.put(("got", got, sums_at_notif))
    agent.close()


def _sender_main(name: str, cmd_q: Any, out_q: Any) -> None:
    from common.transfer.delayed_sender import DelayedWriteSender
    from common.transfer.request_transfer import open_request
    from common.transfer.sender import KVSender, TransferError
    from common.transfer.session import TERMINAL

    torch.manual_seed(0)
    pool = KVPool(_layout(), NUM_PAGES)
    pool.kv.normal_()
    agent = KVTransferAgent(name, pool, model_id=MODEL)
    sender = KVSender(agent)
    held: dict[str, Any] = {}
    out_q.put(("hello", agent.instance_id))
    while True:
        cmd = cmd_q.get(timeout=120)
        op = cmd[0]
        if op == "stop":
            break
        if op == "add_peer":
            try:
                _add_peer(agent, cmd[1])
                out_q.put(("ok",))
            except Exception as e:
                out_q.put(("err", type(e).__name__, str(e)))
        elif op == "has_peer":
            out_q.put(("has_peer", agent.has_peer(cmd[1], cmd[2])))
        elif op == "write":
            # mode "finish": every chunk posted, then the notice on its own; "final": the last chunk with the
            # notice (post_final); "final-pending": the same with earlier writes still in flight (delayed).
            _, peer, chunks, notif, mode = cmd
            via = DelayedWriteSender(agent, 0.3) if mode == "final-pending" else sender
            rt = open_request(via, "req-1", peer, timeout_s=STEP_TIMEOUT_S)
            posted = chunks if mode == "finish" else chunks[:-1]
            for s, d in posted:
                rt.post(torch.tensor(s), torch.tensor(d))
            if mode == "final":  # earlier writes done first, so the notice can ride on the last one
                while any(via.poll(h) == "pending" for h in rt.handles):
                    time.sleep(0.001)
            if mode == "finish":
                state = rt.finish(notif)
            else:
                state = rt.post_final(torch.tensor(chunks[-1][0]), torch.tensor(chunks[-1][1]), notif)
            if state not in TERMINAL:
                state = rt.wait()
            src = torch.tensor([p for s, _ in chunks for p in s])
            out_q.put(
                (
                    "written",
                    state.value,
                    rt.error,
                    [h.num_descs for h in rt.handles],
                    [h.num_runs for h in rt.handles],
                    pool.page_checksums(src).tolist(),
                    rt.notice_attached,
                )
            )
        elif op == "begin":  # a request whose pages were reserved on the peer's current instance
            held["rt"] = open_request(sender, "req-held", cmd[1], timeout_s=STEP_TIMEOUT_S)
            out_q.put(("begun",))
        elif op == "post_held":
            try:
                held["rt"].post(torch.tensor(cmd[1]), torch.tensor(cmd[2]))
                out_q.put(("posted",))
            except TransferError as e:
                out_q.put(("refused", str(e)))
    sender.close()
    agent.close()


# -- parent-side plumbing ----------------------------------------------------------------------------


class _Child:
    def __init__(self, ctx: Any, target: Any, name: str) -> None:
        self.cmd: Any = ctx.Queue()
        self.out: Any = ctx.Queue()
        self.proc = ctx.Process(target=target, args=(name, self.cmd, self.out), daemon=True)
        self.proc.start()

    def send(self, *cmd: Any) -> None:
        self.cmd.put(cmd)

    def recv(self, timeout: float = STEP_TIMEOUT_S) -> tuple[Any, ...]:
        try:
            return self.out.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"child {self.proc.name} gave no answer in {timeout}s (alive={self.proc.is_alive()})"
            ) from None

    def stop(self) -> None:
        if self.proc.is_alive():
            self.send("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
def spawn() -> Any:
    ctx = mp.get_context("spawn")
    children: list[_Child] = []

    def start(target: Any, name: str) -> _Child:
        child = _Child(ctx, target, name)
        children.append(child)
        return child

    yield start
    for child in reversed(children):
        child.stop()


def _write_and_check(sender: _Child, receiver: _Child, peer: str, notif: bytes, mode: str = "finish") -> list[int]:
    dst = [p for _, d in CHUNKS for p in d]
    receiver.send("expect", dst, STEP_TIMEOUT_S, 0.5)
    sender.send("write", peer, CHUNKS, notif, mode)
    _, state, error, descs, runs, src_sums, attached = sender.recv()
    assert state == "landed", error
    # The notice rides on the last write only when every earlier write was done when it was posted.
    assert attached == (mode == "final")
    _, got, sums_at_notif = receiver.recv(STEP_TIMEOUT_S + 5)
    assert got == [("prefill-0", notif)], got  # exactly once
    # Checksummed when the notification was seen: every chunk's data had landed by then.
    assert sums_at_notif == src_sums
    assert runs == CHUNK_RUNS
    return descs


# -- (a) chunked write + notification ordering -------------------------------------------------------


@pytest.mark.parametrize("mode", ["finish", "final", "final-pending"])
def test_chunked_write_lands_before_notification(spawn: Any, mode: str) -> None:
    """However the notice travels (on its own after the writes, on the last write, or on its own because
    earlier writes were still in flight), it arrives exactly once and after every chunk's data."""
    receiver = spawn(_receiver_main, "decode-0")
    sender = spawn(_sender_main, "prefill-0")
    _, hs = receiver.recv()
    sender.recv()
    sender.send("add_peer", hs)
    assert sender.recv() == ("ok",)
    descs = _write_and_check(sender, receiver, "decode-0", b"req-1:first=42", mode)
    # One descriptor per (layer, K/V, run): the pool layout makes a run of pages one block per layer.
    # Page-major pool: one descriptor per run of consecutive pages, whatever the layer count.
    assert descs == CHUNK_RUNS
    assert sum(descs) == sum(CHUNK_RUNS) == 8


# -- (b) layout mismatch -----------------------------------------------------------------------------


FP8 = {"dtype": torch.float8_e4m3fn}
FP8_HALF_V = {**FP8, "kv_scales": (1.0, 0.5) * NUM_LAYERS}


@pytest.mark.parametrize(
    ("field", "local_kwargs", "kwargs"),
    [
        ("head_dim", {}, {"head_dim": 32}),
        ("page_size", {}, {"page_size": 8}),
        ("dtype", {}, FP8),  # a float32 pool and an FP8 one
        ("kv_scales", FP8, FP8_HALF_V),  # two FP8 pools whose pages mean different values
    ],
)
def test_layout_mismatch_is_refused(field: str, local_kwargs: dict[str, Any], kwargs: dict[str, Any]) -> None:
    local = KVTransferAgent("prefill-b", KVPool(_layout(**local_kwargs), 8), model_id=MODEL)
    remote = KVTransferAgent(f"decode-b-{field}", KVPool(_layout(**kwargs), 8), model_id=MODEL)
    try:
        with pytest.raises(LayoutMismatch, match=field) as exc:
            _add_peer(local, _handshake(remote))
        assert set(exc.value.fields) == {field}
        assert not local.has_peer(remote.name)
    finally:
        remote.close()
        local.close()


def test_check_compatible_names_every_field() -> None:
    a = layout_info(KVPool(_layout(), 2), MODEL)
    b = replace(a, head_dim=32, dtype="bfloat16", model_id="other", tp_size=2)
    check_compatible(a, replace(a))
    check_compatible(a, replace(a, tp_size=2))  # ranks are matched per head range instead
    with pytest.raises(LayoutMismatch) as exc:
        check_compatible(a, b)
    assert set(exc.value.fields) == {"head_dim", "dtype", "model_id"}
    for name in exc.value.fields:
        assert name in str(exc.value)
    assert isinstance(exc.value, ValueError)
    assert a.layout_version == LAYOUT_VERSION and a.dtype == "float32"


def test_handshake_pieces_must_agree() -> None:
    local = KVTransferAgent("prefill-h", KVPool(_layout(), 8), model_id=MODEL)
    remote = KVTransferAgent("decode-h", KVPool(_layout(), 8), model_id=MODEL)
    try:
        hs = _handshake(remote)
        with pytest.raises(PeerError, match="instance"):
            _add_peer(local, {**hs, "instance_id": "0" * 32})
        with pytest.raises(PeerError):
            _add_peer(local, {**hs, "pool_info_b64": "not base64!"})
        assert not local.has_peer("decode-h")
        _add_peer(local, hs)
        _add_peer(local, hs)  # same instance again: a no-op
        assert local.has_peer("decode-h", remote.instance_id)
        assert local.remove_peer("decode-h") and not local.has_peer("decode-h")
    finally:
        remote.close()
        local.close()


# -- (c) restarted receiver --------------------------------------------------------------------------


def test_restarted_receiver_is_readded(spawn: Any) -> None:
    first = spawn(_receiver_main, "decode-0")
    sender = spawn(_sender_main, "prefill-0")
    _, hs1 = first.recv()
    sender.recv()
    sender.send("add_peer", hs1)
    assert sender.recv() == ("ok",)
    _write_and_check(sender, first, "decode-0", b"req-1")
    sender.send("begin", "decode-0")  # pages reserved on the first instance, not yet written
    assert sender.recv() == ("begun",)

    first.proc.terminate()  # crash, no goodbye
    first.proc.join(10)
    second = spawn(_receiver_main, "decode-0")
    _, hs2 = second.recv()
    assert hs2["agent_name"] == hs1["agent_name"] and hs2["instance_id"] != hs1["instance_id"]

    sender.send("add_peer", hs2)
    assert sender.recv() == ("ok",)
    sender.send("has_peer", "decode-0", hs1["instance_id"])
    assert sender.recv() == ("has_peer", False)
    sender.send("has_peer", "decode-0", hs2["instance_id"])
    assert sender.recv() == ("has_peer", True)
    # The request begun against the dead instance must not write into the new one's pages.
    sender.send("post_held", [1], [1])
    reply = sender.recv()
    assert reply[0] == "refused" and "restarted" in reply[1], reply
    _write_and_check(sender, second, "decode-0", b"req-2")


# -- pure helpers ------------------------------------------------------------------------------------


def test_page_runs_vectorized() -> None:
    src = torch.tensor([40, 41, 42, 43, 50, 60, 61])
    dst = torch.tensor([50, 51, 52, 53, 54, 5, 4])
    runs = page_runs(src, dst)
    assert runs.src_start.tolist() == [40, 50, 60, 61]
    assert runs.dst_start.tolist() == [50, 54, 5, 4]
    assert runs.length.tolist() == [4, 1, 1, 1]
    assert page_runs(torch.arange(100), torch.arange(7, 107)).count == 1
    assert page_runs(torch.empty(0), torch.empty(0)).count == 0
    with pytest.raises(ValueError):
        page_runs(torch.arange(3), torch.arange(4))


def test_descriptor_addresses_match_pool() -> None:
    pool = KVPool(_layout(), 16)
    info = PoolInfo.from_pool(pool, "x", "id")
    assert pool_infos_from_b64(pool_infos_to_b64([info])) == [info]
    runs = page_runs(torch.tensor([3, 4, 9]), torch.tensor([0, 1, 5]))
    rows = run_descs(info, runs.src_start, runs.length)
    assert rows.shape == (runs.count, 3)
    for i, (start, n) in enumerate(zip(runs.src_start.tolist(), runs.length.tolist(), strict=True)):
        block = pool.kv[start : start + n]  # every layer, K and V, of n consecutive pages
        assert block.is_contiguous()
        assert int(rows[i, 0]) == block.data_ptr()
        assert int(rows[i, 1]) == block.numel() * block.element_size()


def test_session_moves_each_side_may_make() -> None:
    decode = TransferSession.start("r", "decode")
    assert decode.state is S.REQUESTED  # its pages' ids go to the peer with the reservation
    decode.move(S.CANCELLING, "client went away")
    with pytest.raises(IllegalMove):
        decode.move(S.LANDED)  # given up: only the peer's word (or death) ends it
    decode.move(S.ABANDONED)
    assert decode.terminal and decode.error == "client went away"
    prefill = TransferSession.start("r", "prefill")
    assert prefill.state is S.REQUESTED
    with pytest.raises(IllegalMove):
        TransferSession.start("r2", "decode").move(S.WRITING)  # prefill-only state
    prefill.move(S.WRITING)
    prefill.move(S.LANDED)
    with pytest.raises(IllegalMove):
        prefill.move(S.CANCELLING)  # terminal
