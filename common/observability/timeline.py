"""One request's stage timeline: wall-clock stamps taken by the router, the decode worker and the prefill
worker, merged into one map as the request travels.

Stamps are ``time.time()`` seconds. Within a process (and between a worker's control plane and its engine
process, which share the host's clock) differences are exact; across pods they carry the hosts' clock
offset (NTP keeps it to about a millisecond), which is what the cross-pod stages (``dispatched`` ->
``decode_received``, ``prefill_requested`` -> ``prefill_received``,
``prefill_first_token`` -> ``kv_landed``, ``first_token_sent`` -> ``first_token_router``) include.

Who stamps what (only the stages a request went through are present):

- router: ``router_received`` (the HTTP request entered the handler), ``tokenized``, ``routed`` (the
  placement was chosen; a retry re-stamps it), ``dispatched`` (the generate request was written to the decode
  worker), ``first_token_router`` (every choice's first event is in), ``stream_end`` (the last byte went out);
- decode worker, control plane: ``decode_received``, ``prefill_requested`` (page ids sent to the prefill
  peer), ``first_token_sent`` (the first event was handed to the HTTP stream);
- decode worker, engine: ``decode_engine_received``, ``pages_reserved`` (remote prefill), ``kv_landed`` (the
  peer's notice was read), ``decode_admitted`` (local prefill: the scheduler took it into a prefill batch),
  ``first_token`` (the first token event left the engine loop);
- prefill worker (carried to the decode engine in the KV notice): ``prefill_received`` (control plane),
  ``prefill_engine_received``, ``prefill_admitted``, ``prefill_first_token`` (the prompt's last chunk was
  computed and its token sampled). When the last write completed and the notice went out is the prefill
  worker's own measure (``kvferry_kv_transfer_tail_seconds``); the notice itself carries the stamps.
"""

from __future__ import annotations

import time

__all__ = ["STAGES", "Stamps", "now", "offsets_ms", "ordered", "spans_between"]

Stamps = dict[str, float]

# The order a request passes them in (decode_admitted only without a prefill peer, where the prefill stages
# are absent): a timeline sorted this way is monotone.
STAGES = (
    "router_received",
    "tokenized",
    "routed",
    "dispatched",
    "decode_received",
    "decode_engine_received",
    "pages_reserved",
    "prefill_requested",
    "prefill_received",
    "prefill_engine_received",
    "prefill_admitted",
    "prefill_first_token",
    "kv_landed",
    "decode_admitted",
    "first_token",
    "first_token_sent",
    "first_token_router",
    "stream_end",
)
_RANK = {s: i for i, s in enumerate(STAGES)}


def now() -> float:
    return time.time()


def ordered(stamps: Stamps) -> list[tuple[str, float]]:
    """Known stages in passing order (unknown names are dropped: a newer peer may send more)."""
    return sorted(((s, t) for s, t in stamps.items() if s in _RANK), key=lambda st: _RANK[st[0]])


def offsets_ms(stamps: Stamps, origin: str = "router_received") -> list[dict[str, float | str]]:
    """[{stage, t_ms since `origin`, delta_ms since the previous stage}], in passing order."""
    rows = ordered(stamps)
    if not rows:
        return []
    t0 = stamps.get(origin, rows[0][1])
    out: list[dict[str, float | str]] = []
    prev = t0
    for stage, t in rows:
        out.append({"stage": stage, "t_ms": round((t - t0) * 1e3, 3), "delta_ms": round((t - prev) * 1e3, 3)})
        prev = t
    return out


def spans_between(stamps: Stamps, pairs: tuple[tuple[str, str, str], ...]) -> list[tuple[str, float, float]]:
    """(name, start, end) for each (name, from stage, to stage) whose two stamps are present."""
    return [(name, stamps[a], stamps[b]) for name, a, b in pairs if a in stamps and b in stamps]
