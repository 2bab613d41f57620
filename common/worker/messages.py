"""The messages between a worker's control plane and its engine process: one frozen, tagged msgspec Struct each.

Commands go to the engine (a ``Call`` wraps one whose reply the caller awaits; a bare one is a cast); events
come back, every loop turn's in one ``Batch``. On the pipe (common/worker/channel.py) a message is a JSON object
whose ``"_t"`` names its class; ``encode`` and ``decode`` are the only functions that know that. Payloads are the
typed structs of common/protocol.py, validated once at the pod's edge (its HTTP routes) and passed as they are.

Each role's engine and control plane dispatch on the message's type (a dict keyed by class), never on a
string.
"""

from __future__ import annotations

import re
from typing import Generic, TypeVar

import msgspec

from common.protocol import (
    FinishReason,
    HandshakeRequest,
    KVLayoutInfo,
    LoadSnapshot,
    PrefillRequest,
    SamplingParams,
    TokenIds,
    TokenLine,
)

R = TypeVar("R")


class Wire(msgspec.Struct, frozen=True, tag=True, tag_field="_t", forbid_unknown_fields=True, omit_defaults=True):
    """A message of the engine channel, tagged with its class name."""

    @classmethod
    def name(cls) -> str:
        """The snake_case name logs and errors use (``PrefillFailed`` -> ``prefill_failed``)."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


class Command(Wire, Generic[R]):
    """Control plane -> engine; ``R`` is what the engine's reply to a ``Call`` of it carries."""


class Event(Wire):
    """Engine -> control plane."""


class StreamEvent(Event):
    """An event of one request: goes to that request's stream (``EngineClient.open_stream``)."""

    req_id: str


# ---- replies' results ----------------------------------------------------------------------------------
class PeerAdded(Wire):
    agent_name: str
    instance_id: str
    layout: KVLayoutInfo


class TransferCounts(Wire):
    writes_in_flight: int
    sessions: dict[str, int]  # open transfer sessions by state
    descs: int
    bytes: int
    transfers: int
    posts_deferred: int = 0  # writes put off to a later loop turn for want of staging space


class TransferFigures(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A landed transfer's figures, for the control plane's histograms (common/worker/engine_metrics.py)."""

    peer: str
    bytes: int
    writes: list[tuple[int, float]]  # (bytes, seconds from post to completion seen) of each completed write
    seconds: float | None = None  # first write posted to last write seen complete
    tail: float | None = None  # first token sampled to the notice sent
    span: tuple[float, float] | None = None  # wall clock: first write posted, notice sent (the trace's span)


# ---- commands: every role ------------------------------------------------------------------------------
class Stop(Command[None]):
    pass


class Abort(Command[None]):
    req_id: str
    reason: str = "abort"
    error: str | None = None


# ---- commands: decode side -----------------------------------------------------------------------------
class Generate(Command[None]):
    """A request to decode here, answered as soon as it is queued. With a ``peer`` (a prefill worker's agent and
    instance) its prompt is prefilled there: once its pages are reserved a ``Reserved`` event on its stream
    carries them (the leave to send them to that peer); a request that ends first gets its finish instead."""

    req_id: str
    token_ids: TokenIds
    sampling: SamplingParams
    peer: str | None = None
    peer_instance: str | None = None
    timeout_s: float = 60.0
    received: float | None = None  # the control plane's stamp


class PrefillFailed(Command[None]):
    """The remote prefill cannot finish (its peer shows no progress, or answered nonsense); the peer may still
    write, so the pages stay held until its notice says otherwise (or ``PrefillSettled`` comes)."""

    req_id: str
    error: str


class PrefillSettled(Command[None]):
    """The request's exchange with its peer says no write of it can come (the peer refused it or never got it,
    or its process or engine is gone): its pages are free again, and a request still waiting fails."""

    req_id: str
    error: str


# ---- commands: prefill side ----------------------------------------------------------------------------
class AddPeer(Command[PeerAdded]):
    handshake: HandshakeRequest


class Prefill(Command[None]):
    request: PrefillRequest
    received: float | None = None


class Cancel(Command[None]):
    """A decode worker gave these requests up (its cancel of them, `/internal/cancel`)."""

    dst_agent: str
    dst_instance: str
    req_ids: list[str]


class Unanswered(Command[None]):
    """The control plane answered this request's ``Prefill`` 504: the engine was too late, so the decode worker
    holds its pages until a notice. Sent behind the ``Prefill``: taken, it is aborted (its "closed" notice follows
    once its writes settled); refused, its decode worker is sent the "closed" notice at once."""

    req_id: str


class TransferStats(Command[TransferCounts]):
    pass


# ---- envelopes -----------------------------------------------------------------------------------------
class Call(Wire):
    rpc: int
    cmd: AnyCommand


class Reply(Event):
    """The engine's answer to a ``Call``: its result, or why it refused (``error``, ``code``)."""

    rpc: int
    result: AnyResult | None = None
    error: str | None = None
    code: str | None = None


class Batch(Event):
    """What one engine loop turn produced, in order."""

    items: list[AnyEvent]


# ---- events --------------------------------------------------------------------------------------------
class AgentInfo(Wire):
    """The engine's NIXL agent, as a peer handshakes with it."""

    agent_name: str
    instance_id: str
    agent_metadata_b64: str
    pool_info_b64: str
    layout: KVLayoutInfo


class Ready(Event):
    agent: AgentInfo
    pod: str
    start_phases: dict[str, float] = {}  # phase -> seconds its start took (common/engine/start_phases.py)


class Load(Event):
    snapshot: LoadSnapshot


class Steps(Event):
    decode: list[float]  # [seconds, batch size, ...] of the decode-only steps since the last report


class KVIntegrity(Event):
    violations: int


class KVForcedRelease(Event):
    requests: int  # given-up requests whose pages were freed at the safety deadline, unconfirmed


class Stopping(Event):
    """The engine cannot compute any more and is exiting (a tensor-parallel rank is gone): sent before it fails
    its requests, so the worker is not ready from then on, not only once the process is gone."""

    reason: str


class Tokens(StreamEvent):
    """A generate stream's next line: ``line`` is what the decode worker streams to the router as it is."""

    req_id: str
    line: TokenLine

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.line.finish_reason


class Reserved(StreamEvent):
    """The pages reserved for a remote prefill, to be filled by the peer the request named (decode side)."""

    req_id: str
    pages: list[int]


class PrefillDone(StreamEvent):
    """A prefill for a peer whose KV landed there (prefill side)."""

    req_id: str
    descs: int
    cached_tokens: int
    timeline: dict[str, float] | None = None
    transfer: TransferFigures | None = None


class PrefillError(StreamEvent):
    """A prefill for a peer that ended without its KV landing (prefill side)."""

    req_id: str
    error: str


# ---- the wire ------------------------------------------------------------------------------------------
# The unions a decoder tells apart by the tag; a message type missing here cannot cross the pipe.
AnyCommand = (
    Stop | Abort | Generate | PrefillFailed | PrefillSettled | AddPeer | Prefill | Cancel | Unanswered | TransferStats
)
AnyResult = PeerAdded | TransferCounts
AnyEvent = (
    Reply
    | Ready
    | Load
    | Steps
    | KVIntegrity
    | KVForcedRelease
    | Stopping
    | Tokens
    | Reserved
    | PrefillDone
    | PrefillError
)
Message = AnyCommand | Call | Batch | AnyEvent  # what one send on the pipe carries

# JSON, not msgpack: an int past 64 bits (a stop token id a caller made up) must cross as the engine refuses it.
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Message)


def encode(msg: Wire) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Wire:
    """Raises ``msgspec.DecodeError`` for bytes that are no message (a bug of ours: the pipe is the pod's own)."""
    return _decoder.decode(data)  # type: ignore[no-any-return]
