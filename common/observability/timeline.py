"""One request's stage timeline: ``time.time()`` stamps taken by the router, the decode worker and the prefill
worker (carried in the KV notice), merged into one map as the request travels. Cross-pod stages include the
hosts' clock offset (about a millisecond under NTP). Only the stages a request went through are present.
"""

from __future__ import annotations

import time

__all__ = ["STAGES", "Stamps", "now", "offsets_ms", "ordered", "spans_between"]

Stamps = dict[str, float]

# The order a request passes them in (decode_admitted only with a local prefill): sorted so, a timeline is monotone.
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
    """Known stages in passing order (unknown names dropped: a newer peer may send more)."""
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
    return [(name, stamps[a], stamps[b]) for name, a, b in pairs if a in stamps and b in stamps]
