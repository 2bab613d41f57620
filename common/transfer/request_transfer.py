"""The prefill side of one request's transfer session (common/transfer/session.py): its chunk writes, the
"landed" notice once all completed, and on giving up the "closed" notice once every posted write settled.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from common.protocol import KVNotice, encode
from common.transfer.sender import KVSender, StagingBusy, TransferError, TransferHandle
from common.transfer.session import TERMINAL, S, SessionState, TransferSession

log = logging.getLogger(__name__)


def open_request(sender: KVSender, req_id: str, peer: str, timeout_s: float) -> RequestTransfer:
    """Starts the transfer session of one request to `peer`; its writes must all finish within `timeout_s`."""
    session = TransferSession.start(req_id, "prefill", peer, sender.agent.peer(peer).instance_id)
    return RequestTransfer(sender, session, time.monotonic() + timeout_s)


@dataclass
class TransferTiming:
    first_post: float | None  # its first write posted
    last_done: float | None  # its last write seen complete
    landed: float | None  # the "landed" notice sent
    bytes: int
    writes: list[tuple[int, float]]  # (bytes, completion seen - post started) of each completed write


@dataclass
class RequestTransfer:
    """The prefill side of one request's transfer session (requested -> writing -> landed | cancelling ->
    abandoned).

    NIXL orders a notification after its own transfer's data only, so the "landed" notice rides on the last write
    only when every earlier write is DONE and that one is a single NIXL request; otherwise it is sent once every
    write is DONE (after UCX's flush: placed remotely). Giving up waits for every posted write to settle before
    "closed", on which the decode side frees its pages and the caller may release the local ones."""

    sender: KVSender
    session: TransferSession
    deadline: float  # time.monotonic() seconds
    handles: list[TransferHandle] = field(default_factory=list)
    notice: bytes | None = None  # the "landed" notice, sent once every write is done
    notice_attached: bool = False  # the notice rides on the last write (NIXL delivers it with the data)
    landed_at: float | None = None  # time.monotonic() when every write was seen done (and the notice out)
    # Writes put off for want of staging space, posted in order as `progress` finds space.
    deferred: list[tuple[torch.Tensor, torch.Tensor, bytes | None]] = field(default_factory=list)

    @property
    def state(self) -> SessionState:
        return self.session.state

    @property
    def error(self) -> str | None:
        return self.session.error

    @property
    def peer(self) -> str:
        return self.session.peer

    @property
    def settled(self) -> bool:
        ranks = self.sender.ranks
        own = all(h.settled for h in self.handles)
        return own and (ranks is None or ranks.settled(self.session.req_id))

    def post(self, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        """Posts the write of one ready chunk; `TransferError` once the request is given up."""
        self._check_open()
        self._write(torch.as_tensor(src_pages).reshape(-1), torch.as_tensor(dst_pages).reshape(-1))

    def finish(self, notice: bytes) -> SessionState:
        """Declares the last chunk posted; `notice` goes out once all writes are done."""
        if self.notice is not None:
            raise RuntimeError("finish called twice")
        self.notice = notice
        return self.progress()

    def post_final(self, src_pages: torch.Tensor, dst_pages: torch.Tensor, notice: bytes) -> SessionState:
        """Posts the last chunk and finishes with `notice` (on this write where the class doc allows)."""
        src = torch.as_tensor(src_pages).reshape(-1)
        dst = torch.as_tensor(dst_pages).reshape(-1)
        self._check_open()  # polls the earlier writes: the ones done are known done
        attach = (
            src.numel() > 0
            and self.sender.ranks is None  # other ranks' writes must be done before the notice
            and not self.deferred
            and all(h.state == "done" for h in self.handles)
            and self.sender.single_write(self.peer, int(src.numel()))
        )
        if not attach:
            if src.numel() > 0:
                self._write(src, dst)
            return self.finish(notice)
        self.notice, self.notice_attached = notice, True
        self._write(src, dst, notif=notice)
        return self.progress()

    def _check_open(self) -> None:
        if self.notice is not None:
            raise RuntimeError("post after finish: the notice would not cover this write")
        if self.progress() not in (S.REQUESTED, S.WRITING):
            raise TransferError(self.error or "transfer given up")

    def _write(self, src: torch.Tensor, dst: torch.Tensor, notif: bytes | None = None) -> None:
        """Posts `src` -> `dst` (and the other ranks' writes); a part without staging room, and all after it,
        waits for `progress`."""
        if self.state is S.REQUESTED:
            self.session.move(S.WRITING)
        if self.sender.ranks is not None and src.numel() > 0:
            self.sender.ranks.post(self.session.req_id, self.peer, src, dst, self.session.peer_instance)
        step = self.sender.max_pages_per_post(self.peer)
        self.deferred += [
            (src[lo : lo + step], dst[lo : lo + step], notif) for lo in range(0, max(1, src.numel()), step)
        ]
        self._post_deferred()

    def _post_deferred(self) -> None:
        while self.deferred:
            src, dst, notif = self.deferred[0]
            try:
                handle = self.sender.post_write(
                    self.peer, src, dst, notif=notif, expect_instance=self.session.peer_instance
                )
            except StagingBusy:
                return  # earlier packed writes still hold the space: a later turn posts it
            self.deferred.pop(0)
            self.handles.append(handle)
            if handle.state == "error":
                self.cancel(handle.error or "post failed")
                raise TransferError(self.error or "post failed")

    def progress(self, now: float | None = None) -> SessionState:
        """Non-blocking: polls writes, sends the notice when due, gives up on error or deadline."""
        if self.state in (S.REQUESTED, S.WRITING):
            try:
                self._post_deferred()
            except TransferError:
                return self.state  # given up
            pending = bool(self.deferred)
            for h in self.handles:
                st = self.sender.poll(h)
                if st == "error":
                    self.cancel(h.error or "write failed")
                    return self.state
                pending |= st == "pending"
            if self.sender.ranks is not None:
                st, err = self.sender.ranks.state(self.session.req_id)
                if st == "error":
                    self.cancel(err or "a rank's write failed")
                    return self.state
                pending |= st == "pending"
            if not pending and self.notice is not None:
                try:
                    if not self.notice_attached:
                        self.sender.send_notif(self.peer, self.notice, expect_instance=self.session.peer_instance)
                except Exception as e:
                    self.cancel(f"notice not sent: {e}")
                    return self.state
                self.landed_at = time.monotonic()
                self.session.move(S.LANDED)
                if self.sender.ranks is not None:
                    self.sender.ranks.forget(self.session.req_id)
            elif self.expired(now):
                self.cancel("transfer deadline exceeded")
        elif self.state is S.CANCELLING:
            self.sender.progress()
            if self.settled:
                self._abandon()
        return self.state

    def cancel(self, reason: str = "aborted") -> SessionState:
        """Gives up: cancels what is in flight; "closed" goes out once every write settled."""
        if self.state not in (S.REQUESTED, S.WRITING):
            return self.state
        self.deferred.clear()  # never posted: nothing of them to wait for
        for h in self.handles:
            self.sender.abort(h, f"request given up: {reason}")
        if self.sender.ranks is not None:
            self.sender.ranks.abort(self.session.req_id)
        self.session.move(S.CANCELLING, reason)
        if self.settled:
            self._abandon()
        return self.state

    def wait(self, poll_interval_s: float = 0.0) -> SessionState:
        """Blocks until a terminal state (needs `finish` first)."""
        if self.notice is None:
            raise RuntimeError("wait before finish would only end at the deadline")
        while self.progress() not in TERMINAL:
            time.sleep(poll_interval_s)
        return self.state

    def expired(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) > self.deadline

    @property
    def num_descs(self) -> int:
        return sum(h.num_descs for h in self.handles)

    @property
    def num_bytes(self) -> int:
        return sum(h.num_bytes for h in self.handles)

    def timing(self) -> TransferTiming:
        """What this transfer measured; a write's interval spans post to the poll that saw it complete."""
        done = [h for h in self.handles if h.done_at is not None]
        return TransferTiming(
            first_post=min((h.posted_at for h in self.handles), default=None),
            last_done=max((h.done_at for h in done), default=None),  # type: ignore[type-var]
            landed=self.landed_at,
            bytes=self.num_bytes,
            writes=[(h.num_bytes, h.done_at - h.posted_at) for h in done if h.state == "done"],  # type: ignore[operator]
        )

    def _abandon(self) -> None:
        self.session.move(S.ABANDONED)
        if self.sender.ranks is not None:
            self.sender.ranks.forget(self.session.req_id)
        notice = KVNotice(req_id=self.session.req_id, outcome="closed", error=(self.error or "aborted")[:4000])
        try:
            self.sender.send_notif(self.peer, encode(notice), expect_instance=self.session.peer_instance)
        except Exception as e:  # the peer is gone (or restarted): its pages are not ours to worry about
            log.info("closed notice for %s not sent: %s", self.session.req_id, e)
