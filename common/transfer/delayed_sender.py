"""A test hook (`KVFERRY_FAULT_WRITE_DELAY_S`): a sender whose writes start late and cannot be called back.

Every write starts `delay_s` after it was posted and cannot be called back meanwhile, like a write stuck in
flight: it still lands after an abort. The tests use it to check that a request's pages stay held until every
posted write has settled. Production senders are plain `KVSender`s (`make_sender` picks).
"""

from __future__ import annotations

import logging
import time

from common.transfer.agent import KVTransferAgent
from common.transfer.sender import KVSender, PollState, RankWrites, TransferHandle

log = logging.getLogger(__name__)


class DelayedWriteSender(KVSender):
    def __init__(self, agent: KVTransferAgent, delay_s: float, ranks: RankWrites | None = None) -> None:
        super().__init__(agent, ranks)
        self.delay_s = delay_s
        self._start_at: dict[int, float] = {}  # id(handle) -> when it starts, for posted writes not yet started

    def _begin(self, handle: TransferHandle) -> TransferHandle:
        self._start_at[id(handle)] = handle.posted_at + self.delay_s
        return handle

    def _start_due(self, handle: TransferHandle, now: float) -> list[str] | None:
        """Starts the write if it is due; its NIXL states then, else None (not started, or started before)."""
        at = self._start_at.get(id(handle))
        if at is None or now < at:
            return None
        del self._start_at[id(handle)]
        return self._start(handle)

    def poll(self, handle: TransferHandle) -> PollState:
        if (
            handle.state == "pending"
            and id(handle) in self._start_at
            and self.agent.has_peer(handle.peer, handle.peer_instance)
        ):
            try:
                states = self._start_due(handle, time.monotonic())
            except Exception as e:
                self._fail(handle, f"transfer: {type(e).__name__}: {e}")
                return handle.state
            if states is None:
                return handle.state
            return self._after_start(handle, states).state
        return super().poll(handle)

    def progress(self) -> None:
        now = time.monotonic()
        for handle in self._unsettled:
            try:
                self._start_due(handle, now)  # the write that could not be called back lands now
            except Exception as e:
                log.warning("delayed write to %s: %s", handle.peer, e)
        super().progress()

    def _try_release(self, handle: TransferHandle) -> bool:
        if id(handle) in self._start_at:
            return True  # posted, not started: it cannot be called back
        return super()._try_release(handle)


def make_sender(agent: KVTransferAgent, ranks: RankWrites | None = None, fault_write_delay_s: float = 0.0) -> KVSender:
    """The sender a prefill worker runs: a plain `KVSender`, or under the test hook a `DelayedWriteSender`."""
    if fault_write_delay_s > 0:
        return DelayedWriteSender(agent, fault_write_delay_s, ranks)
    return KVSender(agent, ranks)
