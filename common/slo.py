"""The service-level objectives a deployment declares: request classes in priority order, each with TTFT and
ITL targets (docs/architecture.md, "SLOs"). Spec: ``name:key=value,...;name:...``, keys ``ttft`` and ``itl``
(milliseconds, or an ``ms`` / ``s`` suffix; ``ttft=none``: never shed) and ``p`` (the percentile held).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_SLO_SPEC", "SloClass", "SloClasses", "parse_slo_classes"]

DEFAULT_SLO_SPEC = "interactive:ttft=1s,itl=50ms,p=99;batch:ttft=none,itl=200ms,p=99"
# A class without a TTFT target gets a queue deadline this many of the tightest TTFT target after arrival: it
# gives way to the others while they are within theirs, and is never starved.
PATIENCE_TARGETS = 10.0
# Of a class's ITL target, the most that may be left to the path after the engine (relay and network): the engine's
# steps never aim below 80% of the target, whatever the relay measures.
MAX_ALLOWANCE_SHARE = 0.2


@dataclass(frozen=True)
class SloClass:
    name: str
    rank: int  # 0: the highest priority (sheds last)
    ttft_s: float | None  # None: no TTFT target (queues; never shed for TTFT)
    itl_s: float
    percentile: float = 99.0

    def engine_itl_s(self, allowance_s: float) -> float:
        """The ITL target the engine's steps aim at: the class's less what the path after the engine takes (at most
        MAX_ALLOWANCE_SHARE of it: past that, the relay, not the engine, must change)."""
        return self.itl_s - min(max(allowance_s, 0.0), MAX_ALLOWANCE_SHARE * self.itl_s)

    def describe(self) -> str:
        ttft = "none" if self.ttft_s is None else f"{self.ttft_s * 1000:g}ms"
        return f"{self.name}:ttft={ttft},itl={self.itl_s * 1000:g}ms,p={self.percentile:g}"


@dataclass(frozen=True)
class SloClasses:
    classes: tuple[SloClass, ...]
    default: str

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("at least one SLO class is needed")
        if self.default not in self.names:
            raise ValueError(f"the default SLO class {self.default!r} is not declared ({', '.join(self.names)})")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    def get(self, name: str) -> SloClass:
        for c in self.classes:
            if c.name == (name or self.default):
                return c
        raise ValueError(f"unknown SLO class {name!r}; this deployment declares {', '.join(self.names)}")

    def by_priority(self, priority: int) -> SloClass:
        """vLLM's ``priority`` (lower is sooner): the default class shifted by that many ranks, clamped."""
        rank = self.get("").rank + priority
        return self.classes[min(max(rank, 0), len(self.classes) - 1)]

    def queue_deadline(self, cls: SloClass, arrival_s: float) -> float:
        """The request's TTFT deadline (without a target, PATIENCE_TARGETS of the tightest later: never infinite,
        which would starve the class)."""
        if cls.ttft_s is not None:
            return arrival_s + cls.ttft_s
        targets = [c.ttft_s for c in self.classes if c.ttft_s is not None]
        return arrival_s + PATIENCE_TARGETS * (min(targets) if targets else 1.0)

    def spec(self) -> str:
        return ";".join(c.describe() for c in self.classes)


def _seconds(text: str, key: str) -> float:
    value = text.strip().lower()
    scale = 1e-3
    if value.endswith("ms"):
        value = value[:-2]
    elif value.endswith("s"):
        value, scale = value[:-1], 1.0
    seconds = float(value) * scale
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{key}={text!r}: a target must be a positive time")
    return seconds


def parse_slo_classes(spec: str, default: str = "") -> SloClasses:
    """Parses a ``KVFERRY_SLO_CLASSES`` spec; `default` "" makes the first class the default."""
    classes: list[SloClass] = []
    for rank, part in enumerate(p for p in spec.split(";") if p.strip()):
        name, _, body = part.partition(":")
        name = name.strip()
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"SLO class name {name!r}: letters, digits, '-' and '_' only")
        if name in (c.name for c in classes):
            raise ValueError(f"SLO class {name!r} is declared twice")
        fields: dict[str, str] = {}
        for item in (i for i in body.split(",") if i.strip()):
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "itl", "p"):
                raise ValueError(f"SLO class {name!r}: {item.strip()!r} is not ttft=, itl= or p=")
            fields[key] = value.strip()
        if "itl" not in fields:
            raise ValueError(f"SLO class {name!r} needs an itl target")
        ttft = fields.get("ttft", "none")
        percentile = float(fields.get("p", "99"))
        if not 0 < percentile <= 100:
            raise ValueError(f"SLO class {name!r}: p={percentile:g} is not a percentile in (0, 100]")
        classes.append(
            SloClass(
                name=name,
                rank=rank,
                ttft_s=None if ttft.lower() == "none" else _seconds(ttft, "ttft"),
                itl_s=_seconds(fields["itl"], "itl"),
                percentile=percentile,
            )
        )
    if not classes:
        raise ValueError("at least one SLO class is needed")
    return SloClasses(tuple(classes), default or classes[0].name)
