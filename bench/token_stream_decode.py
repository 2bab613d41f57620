"""The router's cost per line of a decode worker's NDJSON token stream: bytes in, a typed event out.

    python bench/token_stream_decode.py            # CPU; writes bench/out/token_stream_decode_cpu.json

`typed` is what the router runs (common/protocol.py `decode(line, TokenLine)`: msgspec, straight from the
line's bytes, validated). `hand` is the parser it replaced, kept here as the reference: the line decoded to
text, `orjson.loads`, then each field picked out of the dict into a dataclass, unvalidated. Both run in this
process on the same lines, so the ratio is measured in one run. Lines as a decode worker writes them
(encoded with the same struct): a mid-stream token, the first line (prompt counts and ~12 stage stamps),
the last (a finish), and a token with 5 top logprobs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson

from common.protocol import TokenLine, TokenLogprob, decode, encode

OUT = Path(__file__).resolve().parent / "out" / "token_stream_decode_cpu.json"


@dataclass
class HandParsedEvent:
    """The router's hand-parsed stream event before the typed wire (reference only)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    retryable: bool = False
    timeline: dict[str, float] | None = None
    overloaded: bool = False

    @classmethod
    def parse(cls, line: str) -> HandParsedEvent:
        d = orjson.loads(line)
        return cls(
            token_ids=d.get("token_ids") or [],
            logprobs=d.get("logprobs"),
            finish_reason=d.get("finish_reason"),
            error=d.get("error"),
            prompt_tokens=d.get("prompt_tokens") or 0,
            cached_tokens=d.get("cached_tokens") or 0,
            retryable=bool(d.get("retryable")),
            timeline=d.get("timeline"),
            overloaded=bool(d.get("overloaded")),
        )


def lines() -> dict[str, bytes]:
    stages = [
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
    ]
    timeline = {s: 1764800000.0 + i * 0.00123 for i, s in enumerate(stages)}
    top = [(1000 + i, -0.5 - i) for i in range(5)]
    return {
        "token": encode(TokenLine(token_ids=[31337])),
        "first": encode(TokenLine(token_ids=[42], prompt_tokens=812, cached_tokens=512, timeline=timeline)),
        "finish": encode(TokenLine(token_ids=[2], finish_reason="stop")),
        "logprobs": encode(TokenLine(token_ids=[1000], logprobs=[TokenLogprob(logprob=-0.5, top=top)])),
    }


def per_line_ns(fn: Any, line: bytes, n: int, repeats: int) -> float:
    """Median over `repeats` of the mean time of `n` calls (the GC left on: the router runs with it)."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn(line)
        samples.append((time.perf_counter_ns() - t0) / n)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per timing")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    def typed(line: bytes) -> TokenLine:
        return decode(line, TokenLine)

    def hand(line: bytes) -> HandParsedEvent:
        return HandParsedEvent.parse(line.decode())  # the wire client handed the parser text

    results: dict[str, Any] = {}
    for kind, line in lines().items():
        a, b = typed(line), hand(line)  # the same event either way
        assert a.token_ids == b.token_ids and a.timeline == b.timeline and a.finish_reason == b.finish_reason
        hand_ns = per_line_ns(hand, line, args.n, args.repeats)
        typed_ns = per_line_ns(typed, line, args.n, args.repeats)
        results[kind] = {
            "bytes": len(line),
            "hand_ns": round(hand_ns, 1),
            "typed_ns": round(typed_ns, 1),
            "hand_over_typed": round(hand_ns / typed_ns, 2),
        }
        print(
            f"{kind:9s} {len(line):4d} B  hand {hand_ns:7.0f} ns  typed {typed_ns:7.0f} ns  x{hand_ns / typed_ns:.2f}"
        )
    # A streamed request's mix: one first line, a finish, and the rest single tokens (256 tokens out).
    mix = {"first": 1, "finish": 1, "token": 254}
    hand_mix = sum(results[k]["hand_ns"] * c for k, c in mix.items()) / 256
    typed_mix = sum(results[k]["typed_ns"] * c for k, c in mix.items()) / 256
    results["stream_of_256"] = {
        "hand_ns": round(hand_mix, 1),
        "typed_ns": round(typed_mix, 1),
        "hand_over_typed": round(hand_mix / typed_mix, 2),
    }
    print(
        f"a 256-token stream, per line: hand {hand_mix:.0f} ns, typed {typed_mix:.0f} ns, x{hand_mix / typed_mix:.2f}"
    )
    OUT.parent.mkdir(exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "n": args.n, "repeats": args.repeats}
    OUT.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
