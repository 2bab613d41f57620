"""Tensor-parallel ranks that send their own KV: rank 0 tells the followers what to write, they report back.

Where a worker's ranks run NIXL agents of their own (GPUs: a rank's memory can be registered only by its own
process; common/transfer/rank_agents.py), a prefill worker's rank 0 cannot move the followers' heads. So each
rank posts its own: rank 0's `FollowerWrites` (the `RankWrites` its `RequestTransfer`s consult) sends every
peer handshake and every chunk's pages to the followers as side messages on the step channel, in order with
the steps (a chunk's post follows the step that computed it), and reads each follower's progress from the
group's key-value store; a follower's `RankSender` posts the writes from its agent and publishes, per request,
how many posts it took, whether they are done or failed, and whether NIXL let go of them all.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from common.protocol import HandshakeRequest, convert, to_builtins
from common.transfer.agent import KVTransferAgent
from common.transfer.rank_agents import RankStore
from common.transfer.sender import KVSender, PollState, TransferHandle

log = logging.getLogger("kvferry.transfer")

KEY = "kvferry/rank-writes/{rank}/{req}"


class SideChannel(Protocol):
    """What is used of rank 0's followers handle (common/engine/tp_ranks.py `TPFollowers`)."""

    def send_side(self, payload: bytes) -> None: ...


@dataclass(frozen=True)
class RankReport:
    posts: int
    state: PollState
    settled: bool
    error: str | None

    def encode(self) -> str:
        return json.dumps([self.posts, self.state, self.settled, self.error])

    @classmethod
    def decode(cls, raw: bytes) -> RankReport:
        posts, state, settled, error = json.loads(raw)
        return cls(int(posts), state, bool(settled), error)


class FollowerWrites:
    """Rank 0: the followers' part of every request's transfer (`common.transfer.sender.RankWrites`)."""

    def __init__(self, followers: SideChannel, store: RankStore, world_size: int) -> None:
        self.followers = followers
        self.store = store
        self.ranks = range(1, world_size)
        self.posts: dict[str, int] = {}

    def _send(self, **msg: object) -> None:
        self.followers.send_side(json.dumps(msg).encode())

    def add_peer(self, handshake: HandshakeRequest) -> None:
        self._send(kind="add_peer", handshake=to_builtins(handshake))

    def post(self, req_id: str, peer: str, src: torch.Tensor, dst: torch.Tensor, expect_instance: str) -> None:
        self.posts[req_id] = self.posts.get(req_id, 0) + 1
        self._send(kind="post", req=req_id, peer=peer, src=src.tolist(), dst=dst.tolist(), instance=expect_instance)

    def _reports(self, req_id: str) -> list[RankReport | None]:
        out: list[RankReport | None] = []
        for rank in self.ranks:
            key = KEY.format(rank=rank, req=req_id)
            out.append(RankReport.decode(self.store.get(key)) if self.store.check([key]) else None)
        return out

    def state(self, req_id: str) -> tuple[PollState, str | None]:
        want = self.posts.get(req_id, 0)
        if want == 0:
            return "done", None
        pending = False
        for rep in self._reports(req_id):
            if rep is not None and rep.state == "error":
                return "error", rep.error
            pending |= rep is None or rep.posts < want or rep.state == "pending"
        return ("pending" if pending else "done"), None

    def settled(self, req_id: str) -> bool:
        want = self.posts.get(req_id, 0)
        return want == 0 or all(r is not None and r.posts >= want and r.settled for r in self._reports(req_id))

    def abort(self, req_id: str) -> None:
        if self.posts.get(req_id):
            self._send(kind="abort", req=req_id)

    def forget(self, req_id: str) -> None:
        if self.posts.pop(req_id, 0):
            self._send(kind="forget", req=req_id)


@dataclass
class _Request:
    handles: list[TransferHandle] = field(default_factory=list)
    posts: int = 0  # post messages taken (one may fail before it becomes a handle)
    error: str | None = None
    forgotten: bool = False
    reported: str = ""


class RankSender:
    """A follower: posts the writes rank 0 asks for from this rank's agent and reports on them."""

    def __init__(self, agent: KVTransferAgent, store: RankStore, rank: int) -> None:
        self.agent = agent
        self.store = store
        self.rank = rank
        self.sender = KVSender(agent)
        self.requests: dict[str, _Request] = {}

    def handle(self, raw: bytes) -> None:
        msg = json.loads(raw)
        kind = msg.pop("kind")
        if kind == "add_peer":
            hs = convert(msg["handshake"], HandshakeRequest)
            try:
                self.agent.add_peer(hs.agent_name, hs.instance_id, hs.agent_metadata_b64, hs.pool_info_b64, hs.layout)
            except Exception as e:  # its posts will fail and say so; rank 0 accepted the same handshake
                log.warning("rank %d could not add peer %s: %s", self.rank, hs.agent_name, e)
            return
        req = self.requests.setdefault(msg["req"], _Request())
        if kind == "post":
            if self.agent.pool.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the step that computed the pages must be done
            req.posts += 1
            try:
                src, dst = torch.tensor(msg["src"]), torch.tensor(msg["dst"])
                step = self.sender.max_pages_per_post(msg["peer"])
                for lo in range(0, src.numel(), step):
                    h = self.sender.post_write(
                        msg["peer"], src[lo : lo + step], dst[lo : lo + step], expect_instance=msg["instance"]
                    )
                    req.handles.append(h)
            except Exception as e:  # an unknown peer (its add_peer failed), bad pages
                req.error = f"rank {self.rank}: {type(e).__name__}: {e}"
        elif kind == "abort":
            for h in req.handles:
                self.sender.abort(h, "request given up")
        elif kind == "forget":
            req.forgotten = True
        self.progress()

    def progress(self) -> None:
        if not self.requests:
            return
        self.sender.progress()
        for req_id, req in list(self.requests.items()):
            states = [self.sender.poll(h) for h in req.handles]
            error = req.error or next((h.error for h in req.handles if h.state == "error"), None)
            state: PollState = "error" if error else ("pending" if "pending" in states else "done")
            settled = all(h.settled for h in req.handles)
            key = KEY.format(rank=self.rank, req=req_id)
            if req.forgotten and settled:
                del self.requests[req_id]
                if req.reported:
                    self.store.delete_key(key)
                continue
            report = RankReport(req.posts, state, settled, error).encode()
            if report != req.reported:
                self.store.set(key, report)
                req.reported = report
