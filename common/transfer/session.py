"""One request's KV transfer, as a state machine both workers run (each its own copy, one per request).

How one request's KV moves (the decode worker D reserved pages, the prefill worker P fills them):

    D: requested (pages reserved, their ids handed to the control plane for P)
    P: requested --(first chunk's write posted)--> writing --(every write done, notice sent)--> landed
    D: requested --(P's "landed" notice)--> landed: the request decodes in its pages

    Either side gives up (abort, deadline, error, a peer that restarted):
    P: requested|writing --> cancelling --(every posted write completed or was cancelled)--> abandoned,
       then P sends the "closed" notice: no write for this request follows it
    D: requested --> cancelling --(P's "closed" or "landed" notice, or the request's exchange with P ending
       in a way that rules out a write: P refused the request, or P's process or engine is gone)--> abandoned

Pages are given back only in a terminal state (landed, abandoned), the one that rules out a later write
into them (D) or a later read from them (P): a peer's notice comes after all of that request's writes on
its side settled, and a peer process that is gone (refused connection, another instance behind its
address) writes nothing. A timer alone never frees pages; D's last resort, `SAFETY_DEADLINE_S` after it
gave up without hearing from a live-looking peer, is logged and counted as a forced release.

The notice is the only message on the NIXL side channel (`common.protocol.KVNotice`); it is validated on
receipt and one that fails validation fails its own request only (see `common/transfer/receiver.py`).
Who moves what: P in `common/transfer/sender.py` (`RequestTransfer`), D in `common/transfer/receiver.py`
(`KVReceiver`); the worker loops map terminal states onto their schedulers' pages.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

Side = Literal["prefill", "decode"]

# Seconds after D gave up on a request whose peer neither confirmed nor is known gone, before D frees the
# pages anyway. Far beyond any transfer deadline (a prefill worker's writes end at its own deadline, which
# D sets); reaching it means a peer that is alive but silent, which an operator should hear about.
SAFETY_DEADLINE_S = 300.0


class SessionState(enum.Enum):
    REQUESTED = "requested"  # the peer was asked (decode) / the request was accepted (prefill)
    WRITING = "writing"  # prefill: at least one write posted
    LANDED = "landed"  # terminal: every write done and the notice sent (prefill) / received (decode)
    CANCELLING = "cancelling"  # given up; a write may still be in flight, so the pages stay held
    ABANDONED = "abandoned"  # terminal: given up, and no write of this request can land any more


S = SessionState
TERMINAL = frozenset({S.LANDED, S.ABANDONED})

# The moves each side may make. Decode: REQUESTED -> ABANDONED on the peer's "closed" notice, its refusal or
# its death. Prefill: straight to ABANDONED when nothing was posted or everything posted has settled.
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
