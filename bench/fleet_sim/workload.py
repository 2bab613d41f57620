"""Requests for the simulator: public traces (../shared/traces), this project's recorded bench/serve.py runs,
and synthetic Poisson or bursty loads, all as arrival time + lengths (+ prefix blocks where known)."""

from __future__ import annotations

import csv
import gzip
import json
import lzma
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import IO

__all__ = [
    "SimRequest",
    "azure",
    "burst",
    "mooncake",
    "open_text",
    "poisson",
    "ramp",
    "recorded_point",
    "scale_rate",
    "swing",
    "trace_file",
]

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
MOONCAKE_BLOCK = 512  # tokens per hash_id in the Mooncake trace


@dataclass(frozen=True, slots=True)
class SimRequest:
    t: float  # arrival, seconds from the start
    prompt: int
    output: int
    blocks: tuple[int, ...] = ()  # prefix blocks (same id: same tokens); empty: nothing shared
    block_tokens: int = MOONCAKE_BLOCK


def _interned(blocks: Iterable[int], ids: dict[int, int]) -> tuple[int, ...]:
    """`blocks` as the one int object `ids` keeps per id: the prefix caches then find a block by identity, not by
    comparing two equal ints' digits (a parsed trace gives each occurrence an object of its own)."""
    return tuple([ids.setdefault(b, b) for b in blocks])


def open_text(path: Path) -> IO[str]:
    """A trace file as text: xz- or gzip-compressed by its suffix, else plain."""
    if path.suffix == ".xz":
        return lzma.open(path, "rt")
    if path.suffix == ".gz":
        return gzip.open(path, "rt")
    return path.open()


def _mooncake_rows(f: Iterable[str]) -> list[SimRequest]:
    """Mooncake's JSON lines: `timestamp` in ms, `input_length`, `output_length`, `hash_ids` (512-token blocks)."""
    out: list[SimRequest] = []
    ids: dict[int, int] = {}
    for line in f:
        if not line.strip():
            continue
        r = json.loads(line)
        blocks = _interned(r.get("hash_ids") or (), ids)
        out.append(SimRequest(r["timestamp"] / 1000, r["input_length"], max(1, r["output_length"]), blocks))
    return sorted(out, key=lambda r: r.t)


def _csv_rows(f: Iterable[str], where: str) -> list[SimRequest]:
    """Azure's LLM inference traces (TIMESTAMP as a date, ContextTokens, GeneratedTokens) or BurstGPT's (Timestamp
    in seconds, Request tokens, Response tokens; its failed requests, with no response, left out)."""
    rows = csv.DictReader(f)
    cols = set(rows.fieldnames or ())
    out, t0 = [], None
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= cols:
        for row in rows:
            stamp = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            t0 = stamp if t0 is None else t0
            out.append(SimRequest(stamp - t0, int(row["ContextTokens"]), max(1, int(row["GeneratedTokens"]))))
    elif {"Timestamp", "Request tokens", "Response tokens"} <= cols:
        for row in rows:
            if int(row["Response tokens"]) <= 0:
                continue
            out.append(SimRequest(float(row["Timestamp"]), int(row["Request tokens"]), int(row["Response tokens"])))
        t0 = min((r.t for r in out), default=0.0)
        out = [replace(r, t=r.t - t0) for r in out]
    else:
        raise ValueError(
            f"{where}: not a trace this reads (columns {sorted(cols)}): Azure's TIMESTAMP, ContextTokens, "
            "GeneratedTokens or BurstGPT's Timestamp, Request tokens, Response tokens"
        )
    return sorted(out, key=lambda r: r.t)


def trace_file(path: Path) -> list[SimRequest]:
    """A request trace in one of the public formats, by its name: JSON lines as Mooncake's traces write them
    (conversation, tool-agent, synthetic), CSV as Azure's or BurstGPT's; `.xz` / `.gz` read compressed."""
    stem = path.name.removesuffix(".xz").removesuffix(".gz")
    with open_text(path) as f:
        if stem.endswith((".jsonl", ".json")):
            return _mooncake_rows(f)
        if stem.endswith(".csv"):
            return _csv_rows(f, path.name)
    raise ValueError(f"{path.name}: a trace is .jsonl (Mooncake's fields) or .csv (Azure's or BurstGPT's columns)")


def mooncake(path: Path | None = None) -> list[SimRequest]:
    return trace_file(path or TRACES / "mooncake_fast25_conversation.jsonl.xz")


def azure(path: Path | None = None) -> list[SimRequest]:
    return trace_file(path or TRACES / "azure_llm_2023_conv.csv.xz")


def scale_rate(reqs: list[SimRequest], factor: float, span_s: float | None = None) -> list[SimRequest]:
    """The trace `factor` times as fast, repeated (shifted by its own span) to fill `span_s` if given: a 1 h
    trace at 100x runs 36 s, so 100 copies fill the hour again, with fresh block ids per copy."""
    base = [SimRequest(r.t / factor, r.prompt, r.output, r.blocks, r.block_tokens) for r in reqs]
    if span_s is None or not base:
        return base
    period = max(base[-1].t, 1e-3)
    out, copy = [], 0
    while copy * period < span_s:
        shift, tag = copy * period, copy << 32
        ids: dict[int, int] = {}
        out += [
            SimRequest(r.t + shift, r.prompt, r.output, _interned((b | tag for b in r.blocks), ids), r.block_tokens)
            for r in base
            if r.t + shift < span_s
        ]
        copy += 1
    return out


def poisson(
    rate: float, span_s: float, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0
) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= span_s:
            return out
        out.append(SimRequest(t, rng.randint(*prompt), rng.randint(*output)))


def burst(reqs: list[SimRequest], at_s: float, length_s: float, extra_rate: float, seed: int = 1) -> list[SimRequest]:
    """`reqs` plus a burst of `extra_rate` requests/s for `length_s` from `at_s`, lengths drawn from `reqs`."""
    rng = random.Random(seed)
    t, extra = at_s, []
    while extra_rate > 0:
        t += rng.expovariate(extra_rate)
        if t >= at_s + length_s:
            break
        like = rng.choice(reqs)
        extra.append(SimRequest(t, like.prompt, like.output))
    return sorted(reqs + extra, key=lambda r: r.t)


def ramp(
    reqs: list[SimRequest], at_s: float, length_s: float, extra_rate: float, until_s: float, seed: int = 1
) -> list[SimRequest]:
    """`reqs` plus extra requests whose rate rises linearly from 0 at `at_s` to `extra_rate` requests/s at
    `at_s + length_s` and holds there until `until_s`, lengths drawn from `reqs` (Poisson at `extra_rate`,
    each arrival kept with the ramp's share of it)."""
    rng = random.Random(seed)
    t, extra = at_s, []
    while extra_rate > 0:
        t += rng.expovariate(extra_rate)
        if t >= until_s:
            break
        keep = rng.random() < min(1.0, (t - at_s) / length_s) if length_s > 0 else True
        like = rng.choice(reqs)
        if keep:
            extra.append(SimRequest(t, like.prompt, like.output))
    return sorted(reqs + extra, key=lambda r: r.t)


def swing(
    low: float, high: float, period_s: float, span_s: float, prompt: int, output: int, seed: int = 0
) -> list[SimRequest]:
    """Poisson arrivals whose rate alternates between `low` and `high` requests/s every `period_s` / 2."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while t < span_s:
        rate = high if (t % period_s) >= period_s / 2 else low
        t += rng.expovariate(rate)
        if t < span_s:
            out.append(SimRequest(t, prompt, output))
    return out


def recorded_point(point: dict) -> list[SimRequest]:
    """The exact requests of one recorded bench/serve.py point: each one's send time and lengths."""
    rows = sorted(point["per_request"], key=lambda r: r["sent_ms"])
    return [SimRequest(r["sent_ms"] / 1000, int(r["in"]), max(1, int(r["out"]))) for r in rows]
