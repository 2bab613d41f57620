"""The prefill side of one request's transfer session (common/transfer/session.py): it strings the request's
chunk writes (common/transfer/sender.py) together, delivers the "landed" notice once every write completed (on
the last write itself where NIXL's ordering allows, `post_final`), and on giving up waits for every posted
write to settle before it sends the "closed" notice and lets the caller release the request's pages.
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
    """Start the transfer session of one request to `peer`; its writes must all finish within `timeout_s`."""
    session = TransferSession.start(req_id, "prefill", peer, sender.agent.peer(peer).instance_id)
    return RequestTransfer(sender, session, time.monotonic() + timeout_s)


@dataclass
class TransferTiming:
    """One transfer's times (time.monotonic() seconds; None: not yet) and bytes."""

    first_post: float | None  # its first write posted
    last_done: float | None  # its last write seen complete
    landed: float | None  # the "landed" notice sent
    bytes: int
    writes: list[tuple[int, float]]  # (bytes, completion seen - post started) of each completed write


@dataclass
class RequestTransfer:
    """The prefill side of one request's transfer session: its writes to one decode peer and the notice
    that ends them (`session.state`: requested -> writing -> landed | cancelling -> abandoned).

    Ordering: NIXL orders a transfer's own notification after that transfer's data only; separate
    transfer requests may complete in any order (UCX lanes, threads). So the "landed" notice rides on the
    last write (`post_final`) only when every earlier write of the request already reported DONE and the
    last one is a single NIXL request: the decode side then learns of it when the data lands, with no
    separate message after the sender saw DONE. Otherwise (`finish`, or `post_final` with writes still
    in flight) it goes out with `send_notif` once every write reports DONE, so every chunk is still posted
    as soon as it is computed and a request whose pages all sit on the decode side already (zero writes)
    still gets its notice. A write reports DONE after the UCX flush, i.e. once the data is placed remotely.
    Giving up (`cancel`, an error, the deadline) waits for every posted write to settle, then sends the
    "closed" notice: the decode side frees its pages on it, and the caller may release the local ones.
    """

    sender: KVSender
    session: TransferSession
    deadline: float  # time.monotonic() seconds
    handles: list[TransferHandle] = field(default_factory=list)
    notice: bytes | None = None  # the "landed" notice, sent once every write is done
    notice_attached: bool = False  # the notice rides on the last write (NIXL delivers it with the data)
    landed_at: float | None = None  # time.monotonic() when every write was seen done (and the notice out)
    # Writes put off for want of staging space (`StagingBusy`), posted in order as `progress` finds space.
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
        """Post the write of one ready chunk. Raises `TransferError` once the request is given up."""
        self._check_open()
        self._write(torch.as_tensor(src_pages).reshape(-1), torch.as_tensor(dst_pages).reshape(-1))

    def finish(self, notice: bytes) -> SessionState:
        """Declare the last chunk posted; `notice` (a "landed" KVNotice) goes out once all writes are done."""
        if self.notice is not None:
            raise RuntimeError("finish called twice")
        self.notice = notice
        return self.progress()

    def post_final(self, src_pages: torch.Tensor, dst_pages: torch.Tensor, notice: bytes) -> SessionState:
        """Post the last chunk and finish with `notice`; the notice rides on this write when every earlier
        write is done and this one is a single NIXL request (see the class doc), else as `finish` sends it.
        Raises `TransferError` once the request is given up."""
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
        """Before a post: the notice is not out yet, and the request (its writes polled now) not given up."""
        if self.notice is not None:
            raise RuntimeError("post after finish: the notice would not cover this write")
        if self.progress() not in (S.REQUESTED, S.WRITING):
            raise TransferError(self.error or "transfer given up")

    def _write(self, src: torch.Tensor, dst: torch.Tensor, notif: bytes | None = None) -> None:
        """Posts `src` -> `dst` (this rank's writes, and the other ranks' through `sender.ranks`); `notif` rides
        on the write (the caller made sure it is a single one). A part the staging area has no room for yet is
        kept, and so is everything after it, to be posted in order by `progress`."""
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
        """Non-blocking: poll writes, send the notice when due, give up on error or deadline, and end a
        give-up once every write settled."""
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
        """Give up: cancel what is in flight; the "closed" notice goes out once every write settled."""
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
        """Block until a terminal state (at most the deadline plus the time writes take to settle). Needs
        `finish` first."""
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
        """What this transfer measured. A write's interval covers the real transfer (it starts before the post call
        and ends at the poll that saw completion), so bytes over it never exceed the link's speed."""
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
