"""Decode side of every request's transfer session: one `TransferSession` per reservation, the peer's notices
turned into `Arrival`s ("landed", "closed", "released", "malformed") for the worker loop. A notice counts only
from the peer the request was sent to.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Literal

from common.protocol import DecodeError, KVNotice, convert
from common.transfer.agent import KVTransferAgent
from common.transfer.session import SAFETY_DEADLINE_S, S, TransferSession

log = logging.getLogger(__name__)


@dataclass
class Arrival:
    req_id: str
    kind: Literal["landed", "closed", "released", "malformed"]
    peer: str
    notice: KVNotice | None = None
    error: str | None = None


class KVReceiver:
    def __init__(self, agent: KVTransferAgent) -> None:
        self.agent = agent
        self.sessions: dict[str, TransferSession] = {}  # open sessions only: terminal ones are dropped
        self.dropped_notices = 0  # unparseable, unknown request, or from a peer the request was not sent to

    def reserve(self, req_id: str, peer: str, peer_instance: str) -> None:
        """Pages are reserved and their ids go to `peer` (this instance): from now on it may write them."""
        self.sessions[req_id] = TransferSession.start(req_id, "decode", peer, peer_instance)

    def give_up(self, req_id: str, reason: str) -> bool:
        """This side no longer wants the KV; True when the pages may be freed now (no asked peer may write)."""
        s = self.sessions.get(req_id)
        if s is None:
            return True
        if s.state is S.REQUESTED:
            s.move(S.CANCELLING, reason)
        return False

    def settle(self, req_id: str, reason: str) -> bool:
        """No write of this request can come any more: ends its session short of landed; True if there was one."""
        s = self.sessions.get(req_id)
        if s is None:
            return False
        self._end(s, S.ABANDONED, reason)
        return True

    def holds(self, req_id: str) -> bool:
        """Pages of this request must stay allocated: a peer may still write into them."""
        s = self.sessions.get(req_id)
        return s is not None and s.state is S.CANCELLING

    def overdue(self, now: float | None = None) -> list[str]:
        """Given-up sessions whose peer stayed silent past the safety deadline: ended by force."""
        now = time.monotonic() if now is None else now
        late = [s for s in self.sessions.values() if s.state is S.CANCELLING and now - s.since > SAFETY_DEADLINE_S]
        for s in late:
            log.error(
                "KV pages of %s freed without word from %s after %.0f s: a late write could corrupt them",
                s.req_id,
                s.peer,
                now - s.since,
            )
            self._end(s, S.ABANDONED, "safety deadline")
        return [s.req_id for s in late]

    def poll(self) -> list[Arrival]:
        out = []
        for peer, raw in self.poll_notifications():
            arrival = self._read(peer, raw)
            if arrival is not None:
                out.append(arrival)
        return out

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """Non-blocking: (peer agent name, raw message) per notification, in send order per peer (a name alone
        does not prove the instance: messages are matched against requests sent to that peer)."""
        out: list[tuple[str, bytes]] = []
        for name, messages in self.agent.nixl.get_new_notifs().items():
            peer = name.decode() if isinstance(name, bytes) else str(name)
            out.extend((peer, bytes(m)) for m in messages)
        return out

    def _read(self, peer: str, raw: bytes) -> Arrival | None:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            data = None
        req_id = data.get("req_id") if isinstance(data, dict) else None
        s = self.sessions.get(req_id) if isinstance(req_id, str) else None
        if s is None or s.peer != peer or s.state not in (S.REQUESTED, S.CANCELLING):
            self.dropped_notices += 1
            log.warning("KV notice dropped (no open transfer of that request from this peer)", extra={"peer": peer})
            return None
        try:
            notice = convert(data, KVNotice)
        except DecodeError as e:
            error = f"malformed KV notice from {peer}: {e}"
            log.warning(error, extra={"req_id": s.req_id})
            if s.state is S.REQUESTED:
                s.move(S.CANCELLING, error)
                return Arrival(s.req_id, "malformed", peer, error=error)
            return None  # already given up: wait for a valid notice or the peer's death
        if s.state is S.CANCELLING:
            self._end(s, S.ABANDONED)
            return Arrival(s.req_id, "released", peer, notice)
        if notice.outcome == "landed":
            self._end(s, S.LANDED)
            return Arrival(s.req_id, "landed", peer, notice)
        self._end(s, S.ABANDONED, notice.error or "prefill failed")
        return Arrival(s.req_id, "closed", peer, notice, error=notice.error or "prefill failed")

    def _end(self, s: TransferSession, to: S, reason: str | None = None) -> None:
        s.move(to, reason)
        self.sessions.pop(s.req_id, None)
