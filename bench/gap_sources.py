"""Where a served run's shared token gaps came from: each gap over the ITL target that several requests saw at once
(their longest gaps ending together: `shared_gap_events` in bench/serve_metrics.py, each point's `started_at`) lined
up with the engine's step trace (`KVFERRY_STEP_TRACE`, its lines' wall clock `t`), and named:

- `eager launch`: the step launched meanwhile took most of the gap to launch on the host, over the piecewise
  graphs' tokens (`--graphed-tokens`);
- `host`: host time past the step's device time made up the overrun, the launch not explaining it;
- `device`: the step itself ran about as long as the target on the device;
- `downstream`: no step's gap matches: the worker's HTTP process, the router or the client;
- `collection`: downstream, and a process's slow garbage collection (its log's `slow garbage collection` line,
  `--logs`: the run's log directory, searched for *.log) ran during the gap. A host gap with one beside it names
  it too.

    python bench/gap_sources.py SERVE.json[.xz] --mode agg@fp8 --trace steps_fp8.jsonl[.xz] [--target-ms 50]
        [--graphed-tokens 2560] [--logs LOG_DIR] [--out OUT.json]

It also prints the host's launch time by step kind, graphed or eager (the trace's `launch_host_s`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet_sim.workload import open_text  # noqa: E402
from serve_metrics import shared_gap_events  # noqa: E402

BEFORE_S, AFTER_S = 0.02, 0.005  # a step processed this long before or after a gap's end may be what ended it


def read_text(path: str) -> str:
    with open_text(Path(path)) as f:
        return f.read()


@dataclass
class GapEvent:
    point: int  # index of the point in the mode
    rate: float | None
    end_s: float  # wall clock (the point's started_at plus the requests' gap end)
    gap_ms: float  # the longest of the grouped gaps
    streams: int  # requests whose longest gap it was
    cause: str = "downstream"
    step: dict[str, Any] | None = None  # the trace line whose processing ended it
    next_step: dict[str, Any] | None = None  # the one launched meanwhile
    collection: Collection | None = None  # the longest slow garbage collection during it, from the logs


@dataclass
class Collection:
    """A slow garbage collection a serving process logged (common/gc_pauses.py)."""

    log: str  # the log file it is in, under --logs: which process
    at: float  # when it ended, wall clock
    ms: float
    generation: int


def slow_collection_fields(log: Path) -> list[dict[str, str]]:
    """The key=value fields of each `slow garbage collection` line (common/gc_pauses.py) in a log, in order."""
    return [
        dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        for line in log.read_text(errors="replace").splitlines()
        if "slow garbage collection" in line
    ]


def read_collections(log_dir: Path) -> list[Collection]:
    found: list[Collection] = []
    for path in sorted(log_dir.rglob("*.log")):
        for fields in slow_collection_fields(path):
            if "at" in fields and "ms" in fields:  # lines before the field existed cannot be placed
                rel = str(path.relative_to(log_dir))
                found.append(
                    Collection(rel, float(fields["at"]), float(fields["ms"]), int(fields.get("generation", 2)))
                )
    return found


def with_collection(event: GapEvent, collections: list[Collection]) -> GapEvent:
    """Names the longest collection that ran during the gap; a downstream gap's cause becomes `collection`."""
    start = event.end_s - event.gap_ms / 1e3
    during = [c for c in collections if c.at - c.ms / 1e3 <= event.end_s + AFTER_S and c.at >= start - AFTER_S]
    if during:
        event.collection = max(during, key=lambda c: c.ms)
        if event.cause == "downstream":
            event.cause = "collection"
    return event


def shared_gaps(points: list[dict[str, Any]], target_ms: float, min_streams: int = 2) -> list[GapEvent]:
    events: list[GapEvent] = []
    for index, point in enumerate(points):
        start = point.get("started_at")
        if start is None:
            continue
        for g in shared_gap_events(point["per_request"], target_ms, min_streams):
            events.append(
                GapEvent(index, point.get("value"), start + g["end_ms"] / 1e3, g["gap_ms"], int(g["streams"]))
            )
    return events


def attribute(event: GapEvent, steps: list[dict[str, Any]], target_ms: float, graphed_tokens: int) -> GapEvent:
    near = [
        i
        for i, s in enumerate(steps)
        if event.end_s - BEFORE_S <= s["t"] <= event.end_s + AFTER_S and s["kind"] != "prefill"
    ]
    if not near:
        return event
    i = max(near, key=lambda k: steps[k]["gap_s"])
    step = steps[i]
    gap_ms = step["gap_s"] * 1e3
    if gap_ms < 0.8 * min(event.gap_ms, target_ms):
        return event  # the engine's steps came on time: the gap is downstream of it
    event.step = step
    event.next_step = steps[i + 1] if i + 1 < len(steps) else None
    host_ms = gap_ms - step["device_s"] * 1e3
    nxt = event.next_step
    launch_ms = nxt["launch_host_s"] * 1e3 if nxt is not None and "launch_host_s" in nxt else 0.0
    tokens = nxt["prefill_tokens"] + nxt["decode_rows"] if nxt is not None else 0
    if step["device_s"] * 1e3 >= 0.9 * target_ms:
        event.cause = "device"  # the step alone ran about as long as the target
    elif launch_ms >= 0.5 * host_ms > 0 and graphed_tokens > 0 and tokens > graphed_tokens:
        event.cause = "eager launch"
    else:
        event.cause = "host"  # the host's time between steps made up the overrun
    return event


def launch_times(steps: list[dict[str, Any]], graphed_tokens: int) -> dict[str, dict[str, float]]:
    """The host's launch time by kind, a prefill or mixed step split into graphed and eager: p50, p90, max (ms)."""
    groups: dict[str, list[float]] = {}
    for s in steps:
        if "launch_host_s" not in s:
            continue
        kind = s["kind"]
        if kind != "decode" and graphed_tokens > 0:
            kind += " (eager)" if s["prefill_tokens"] + s["decode_rows"] > graphed_tokens else " (graphed)"
        groups.setdefault(kind, []).append(s["launch_host_s"] * 1e3)
    out = {}
    for kind, xs in sorted(groups.items()):
        xs.sort()
        out[kind] = {"n": len(xs), "p50": xs[len(xs) // 2], "p90": xs[int(0.9 * (len(xs) - 1))], "max": xs[-1]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("serve", help="bench/serve.py's JSON (.xz too)")
    p.add_argument("--mode", required=True, help="the mode whose points to read, e.g. agg@fp8")
    p.add_argument("--trace", required=True, help="that mode's engine step trace (KVFERRY_STEP_TRACE; .xz too)")
    p.add_argument("--target-ms", type=float, default=50.0, help="the ITL target: longer gaps are looked at")
    p.add_argument("--graphed-tokens", type=int, default=2560, help="KVFERRY_CUDA_GRAPH_MAX_TOKENS the run had")
    p.add_argument("--logs", help="the run's log directory: its slow garbage collections are lined up too")
    p.add_argument("--out", help="write the events and launch times here as JSON")
    args = p.parse_args(argv)
    run = json.loads(read_text(args.serve))
    if args.mode not in run["modes"]:
        print(f"no mode {args.mode!r} in {args.serve}: {', '.join(run['modes'])}", file=sys.stderr)
        return 2
    if not Path(args.trace).exists():
        print(f"no step trace at {args.trace}", file=sys.stderr)
        return 2
    points = run["modes"][args.mode]["points"]
    steps = [json.loads(line) for line in read_text(args.trace).splitlines() if line.strip()]
    if not steps or "t" not in steps[0]:
        print("the trace has no wall clock (`t`): recorded before the field existed", file=sys.stderr)
        return 2
    events = [attribute(e, steps, args.target_ms, args.graphed_tokens) for e in shared_gaps(points, args.target_ms)]
    if args.logs:
        collections = read_collections(Path(args.logs))
        events = [with_collection(e, collections) for e in events]
    for e in events:
        line = f"point {e.point} ({e.rate} req/s): {e.gap_ms:.1f} ms gap, {e.streams} streams -> {e.cause}"
        if e.step is not None:
            s, n = e.step, e.next_step or {}
            line += (
                f"; step {s['kind']} {s['prefill_tokens']}+{s['decode_rows']} rows, device {s['device_s'] * 1e3:.1f}"
                f" ms, gap {s['gap_s'] * 1e3:.1f} ms; launched meanwhile {n.get('kind')}"
                f" {n.get('prefill_tokens')}+{n.get('decode_rows')} in {n.get('launch_host_s', 0.0) * 1e3:.1f} ms"
            )
        if e.collection is not None:
            c = e.collection
            line += f"; collection in {c.log}: generation {c.generation}, {c.ms:.1f} ms"
        print(line)
    launches = launch_times(steps, args.graphed_tokens)
    for kind, v in launches.items():
        print(f"launch on the host, {kind}: n={v['n']} p50 {v['p50']:.1f} p90 {v['p90']:.1f} max {v['max']:.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"events": [asdict(e) for e in events], "launch_ms": launches}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
