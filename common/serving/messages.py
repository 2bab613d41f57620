"""The messages between a worker's control plane and its engine process, one frozen dataclass each.

Commands go to the engine (a ``Call`` wraps one whose reply the caller awaits; a bare one is a cast); events
come back, every loop turn's in one ``Batch``. On the wire (common/serving/channel.py) a message is a JSON
object whose ``"_t"`` names its class; ``encode`` and ``decode`` are the only functions that know that.
Payloads that are pydantic models of common/protocol.py travel as their dicts and are validated where they
are used, as before.

Each role's engine and control plane dispatch on the message's type (a dict keyed by class), never on a
string.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Generic, TypeVar

TAG = "_t"
R = TypeVar("R")


class Wire:
    """A message of the engine channel; subclasses register themselves for ``decode`` by class name."""

    registry: ClassVar[dict[str, type[Wire]]] = {}
    # Fields holding a message (or a list of messages): encoded and decoded as such. The rest are JSON values
    # passed through untouched, so a list of token ids or page ids is never walked element by element.
    nested: ClassVar[tuple[str, ...]] = ()
    _names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Wire.registry[cls.__name__] = cls

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
@dataclass(frozen=True)
class PeerAdded(Wire):
    agent_name: str
    instance_id: str
    layout: dict[str, Any]  # KVLayoutInfo


@dataclass(frozen=True)
class TransferCounts(Wire):
    writes_in_flight: int
    sessions: dict[str, int]  # open transfer sessions by state
    descs: int
    bytes: int
    transfers: int
    posts_deferred: int = 0  # writes put off to a later loop turn for want of staging space


# ---- commands: every role ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stop(Command[None]):
    pass


@dataclass(frozen=True)
class Abort(Command[None]):
    req_id: str
    reason: str = "abort"
    error: str | None = None


# ---- commands: decode side -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Generate(Command[None]):
    """A request to decode here, answered as soon as it is queued. With a ``peer`` (a prefill worker's agent and
    instance) its prompt is prefilled there: once its pages are reserved a ``Reserved`` event on its stream
    carries them (the leave to send them to that peer); a request that ends first gets its finish instead."""

    req_id: str
    token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams
    peer: str | None = None
    peer_instance: str | None = None
    timeout_s: float = 60.0
    received: float | None = None  # the control plane's stamp


@dataclass(frozen=True)
class PrefillFailed(Command[None]):
    """The remote prefill cannot finish (its peer shows no progress, or answered nonsense); the peer may still
    write, so the pages stay held until its notice says otherwise (or ``PrefillSettled`` comes)."""

    req_id: str
    error: str


@dataclass(frozen=True)
class PrefillSettled(Command[None]):
    """The request's exchange with its peer says no write of it can come (the peer refused it or never got it,
    or its process or engine is gone): its pages are free again, and a request still waiting fails."""

    req_id: str
    error: str


# ---- commands: prefill side ----------------------------------------------------------------------------
@dataclass(frozen=True)
class AddPeer(Command[PeerAdded]):
    handshake: dict[str, Any]  # HandshakeRequest


@dataclass(frozen=True)
class Prefill(Command[None]):
    request: dict[str, Any]  # PrefillRequest
    received: float | None = None


@dataclass(frozen=True)
class Cancel(Command[None]):
    """A decode worker gave these requests up (its cancel of them, `/internal/cancel`)."""

    dst_agent: str
    dst_instance: str
    req_ids: list[str]


@dataclass(frozen=True)
class Unanswered(Command[None]):
    """The control plane answered this request's ``Prefill`` 504: the engine was too late, so the decode worker
    holds its pages until a notice. Sent behind the ``Prefill``: taken, it is aborted (its "closed" notice follows
    once its writes settled); refused, its decode worker is sent the "closed" notice at once."""

    req_id: str


@dataclass(frozen=True)
class TransferStats(Command[TransferCounts]):
    pass


# ---- envelopes -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call(Wire):
    rpc: int
    cmd: Command[Any]
    nested: ClassVar[tuple[str, ...]] = ("cmd",)


@dataclass(frozen=True)
class Reply(Event):
    """The engine's answer to a ``Call``: its result, or why it refused (``error``, ``code``)."""

    rpc: int
    result: Wire | None = None
    error: str | None = None
    code: str | None = None
    nested: ClassVar[tuple[str, ...]] = ("result",)


@dataclass(frozen=True)
class Batch(Event):
    """What one engine loop turn produced, in order."""

    items: list[Event]
    nested: ClassVar[tuple[str, ...]] = ("items",)


# ---- events --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentInfo(Wire):
    """The engine's NIXL agent, as a peer handshakes with it."""

    agent_name: str
    instance_id: str
    agent_metadata_b64: str
    pool_info_b64: str
    layout: dict[str, Any]  # KVLayoutInfo


@dataclass(frozen=True)
class Ready(Event):
    agent: AgentInfo
    pod: str
    nested: ClassVar[tuple[str, ...]] = ("agent",)


@dataclass(frozen=True)
class Load(Event):
    snapshot: dict[str, Any]  # LoadSnapshot


@dataclass(frozen=True)
class Steps(Event):
    decode: list[float]  # [seconds, batch size, ...] of the decode-only steps since the last report


@dataclass(frozen=True)
class KVIntegrity(Event):
    violations: int


@dataclass(frozen=True)
class KVForcedRelease(Event):
    requests: int  # given-up requests whose pages were freed at the safety deadline, unconfirmed


@dataclass(frozen=True)
class Tokens(StreamEvent):
    """A generate stream's next tokens; the first carry the prompt's counts and stage stamps, the last the
    finish reason. ``stream_item`` is the line the decode worker streams to the router."""

    req_id: str
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    timeline: dict[str, float] | None = None
    finish_reason: str | None = None
    error: str | None = None
    kv_verified: bool | None = None
    retryable: bool | None = None  # with "error": the worker lost its engine; the request may continue elsewhere

    def stream_item(self) -> dict[str, Any]:
        return {k: v for k, v in _values(self).items() if k != "req_id" and v is not None}


@dataclass(frozen=True)
class Reserved(StreamEvent):
    """The pages reserved for a remote prefill, to be filled by the peer the request named (decode side)."""

    req_id: str
    pages: list[int]


@dataclass(frozen=True)
class PrefillDone(StreamEvent):
    """A prefill for a peer whose KV landed there (prefill side)."""

    req_id: str
    descs: int
    cached_tokens: int
    timeline: dict[str, float] | None = None
    transfer: dict[str, Any] | None = None  # the transfer's figures (common/serving/engine_metrics.py)


@dataclass(frozen=True)
class PrefillError(StreamEvent):
    """A prefill for a peer that ended without its KV landing (prefill side)."""

    req_id: str
    error: str


# ---- the wire ------------------------------------------------------------------------------------------
def _names(cls: type[Wire]) -> tuple[str, ...]:
    names = cls.__dict__.get("_names")
    if not names:
        names = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
        cls._names = names
    return names


def _values(msg: Wire) -> dict[str, Any]:
    return {n: getattr(msg, n) for n in _names(type(msg))}


def _to_obj(msg: Wire) -> dict[str, Any]:
    obj: dict[str, Any] = {TAG: type(msg).__name__}
    for n in _names(type(msg)):
        v = getattr(msg, n)
        if v is None:
            continue  # the default of every field that may be None: decode gives it back
        if n in msg.nested:
            v = [_to_obj(m) for m in v] if isinstance(v, list) else _to_obj(v)
        obj[n] = v
    return obj


def _from_obj(obj: dict[str, Any]) -> Wire:
    cls = Wire.registry.get(obj.pop(TAG, None))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError("not an engine channel message")
    for n in cls.nested:
        v = obj.get(n)
        if v is not None:
            obj[n] = [_from_obj(m) for m in v] if isinstance(v, list) else _from_obj(v)
    return cls(**obj)


def encode(msg: Wire) -> bytes:
    return json.dumps(_to_obj(msg), separators=(",", ":")).encode()


def decode(data: bytes) -> Wire:
    return _from_obj(json.loads(data))
