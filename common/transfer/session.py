"""One request's KV transfer, as a state machine both workers run, one per request (docs/architecture.md, "One
request's KV transfer"): pages go back only in a terminal state, which rules out a later write or read.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

Side = Literal["prefill", "decode"]

# Seconds after D gave up on a silent, live-looking peer before D frees the pages anyway (far beyond any
# transfer deadline: an operator should hear about it).
SAFETY_DEADLINE_S = 300.0


class SessionState(enum.Enum):
    REQUESTED = "requested"  # the peer was asked (decode) / the request was accepted (prefill)
    WRITING = "writing"  # prefill: at least one write posted
    LANDED = "landed"  # terminal: every write done and the notice sent (prefill) / received (decode)
    CANCELLING = "cancelling"  # given up; a write may still be in flight, so the pages stay held
    ABANDONED = "abandoned"  # terminal: given up, and no write of this request can land any more


S = SessionState
TERMINAL = frozenset({S.LANDED, S.ABANDONED})

# The moves each side may make (decode: REQUESTED -> ABANDONED on "closed", a refusal or the peer's death;
# prefill: straight to ABANDONED when nothing posted is unsettled).
MOVES: dict[Side, dict[SessionState, frozenset[SessionState]]] = {
    "decode": {
        S.REQUESTED: frozenset({S.LANDED, S.CANCELLING, S.ABANDONED}),
        S.CANCELLING: frozenset({S.ABANDONED}),
    },
    "prefill": {
        S.REQUESTED: frozenset({S.WRITING, S.LANDED, S.CANCELLING, S.ABANDONED}),
        S.WRITING: frozenset({S.LANDED, S.CANCELLING, S.ABANDONED}),
        S.CANCELLING: frozenset({S.ABANDONED}),
    },
}


class IllegalMove(RuntimeError):
    """A transition the state machine does not allow: a bug in the caller, never a peer's doing."""


@dataclass
class TransferSession:
    req_id: str
    side: Side
    state: SessionState
    peer: str = ""  # the other side's NIXL agent name
    peer_instance: str = ""  # ... and its process instance: a restarted peer is another one
    error: str | None = None  # why it was given up
    since: float = field(default_factory=time.monotonic)  # when the current state was entered

    @classmethod
    def start(cls, req_id: str, side: Side, peer: str = "", peer_instance: str = "") -> TransferSession:
        return cls(req_id, side, S.REQUESTED, peer, peer_instance)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def can_move(self, to: SessionState) -> bool:
        return to in MOVES[self.side].get(self.state, frozenset())

    def move(self, to: SessionState, error: str | None = None) -> None:
        if not self.can_move(to):
            raise IllegalMove(f"{self.side} transfer of {self.req_id}: {self.state.value} -> {to.value}")
        self.state = to
        self.since = time.monotonic()
        if error is not None and self.error is None:
            self.error = error
