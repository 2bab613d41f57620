"""Summaries of one load point: latency percentiles, throughput, goodput at SLOs, outcome counts, and
where bursts of tokens came from. Pure functions over bench/serve_load.py's records."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from serve_load import LAG_PROBE_PERIOD_S, PointRun, RequestRecord

__all__ = ["SLO", "ClassSLO", "parse_class_slos", "percentiles", "request_itls", "summarize_classes", "summarize_point"]

PCTS = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    itl_p99_s: float = 0.025  # per request: the p99 of its own inter-token gaps


@dataclass(frozen=True)
class ClassSLO:
    """One SLO class's targets (the deployment's KVFERRY_SLO_CLASSES; common/slo.py's spec)."""

    ttft_s: float | None  # None: no TTFT target
    itl_s: float
    percentile: float = 99.0


def parse_class_slos(spec: str) -> dict[str, ClassSLO]:
    from common.slo import parse_slo_classes

    return {c.name: ClassSLO(c.ttft_s, c.itl_s, c.percentile) for c in parse_slo_classes(spec).classes}


def summarize_classes(recs: Sequence[RequestRecord], wall_s: float, targets: dict[str, ClassSLO]) -> dict[str, Any]:
    """Per SLO class the requests sent as it: how many were served, shed (429), within the class's TTFT target,
    within its ITL target (the class's percentile of the request's own gaps), good (both), and the goodput. A
    request's attainment counts against all those sent (a shed request is not good)."""
    out: dict[str, Any] = {}
    wall = max(wall_s, 1e-9)
    for name in sorted({r.slo_class for r in recs if r.slo_class}):
        mine = [r for r in recs if r.slo_class == name]
        slo = targets.get(name, ClassSLO(None, math.inf))
        ok = [r for r in mine if r.outcome == "ok" and r.ttft_s is not None]
        ttft = [r for r in ok if slo.ttft_s is None or r.ttft_s <= slo.ttft_s]  # type: ignore[operator]
        itl = [r for r in ok if not (g := request_itls(r)) or percentile(sorted(g), slo.percentile) <= slo.itl_s]
        good = [r for r in ttft if r in itl]
        sent = len(mine)
        out[name] = {
            "targets": {"ttft_ms": None if slo.ttft_s is None else slo.ttft_s * 1e3, "itl_ms": slo.itl_s * 1e3},
            "requests": sent,
            "completed": len(ok),
            "shed_429": sum(1 for r in mine if r.http_status == 429),
            "ttft_met": len(ttft),
            "itl_met": len(itl),
            "good": len(good),
            "attainment": len(good) / sent if sent else math.nan,
            "attainment_of_completed": len(good) / len(ok) if ok else math.nan,
            "goodput_request_per_s": len(good) / wall,
            "ttft_ms": percentiles(r.ttft_s for r in ok if r.ttft_s is not None),
        }
    return out


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def percentiles(values: Iterable[float], scale: float = 1000.0) -> dict[str, float | int]:
    """p50/p90/p99/mean/max/count, in milliseconds by default (NaN when there are no values)."""
    vs = sorted(values)
    out: dict[str, float | int] = {f"p{q}": percentile(vs, q) * scale for q in PCTS}
    out["mean"] = (sum(vs) / len(vs) * scale) if vs else math.nan
    out["max"] = (vs[-1] * scale) if vs else math.nan
    out["n"] = len(vs)
    return out


def _produced(rec: RequestRecord) -> int:
    """Output tokens of a request: the server's count (usage) when it sent one, else the client's."""
    return rec.usage_tokens if rec.usage_tokens is not None else rec.tokens


def request_itls(rec: RequestRecord) -> list[float]:
    """Gaps between consecutive tokens of one request as the client saw them (tokens that arrived
    together have a 0 gap)."""
    t = rec.token_times
    return [b - a for a, b in zip(t, t[1:])]


def _read_gaps(rec: RequestRecord) -> list[float]:
    """Gaps between arrivals that brought tokens (bursts collapsed): what the stream's rhythm was."""
    distinct = sorted(set(rec.token_times))
    return [b - a for a, b in zip(distinct, distinct[1:])]


def _itl_ok(itls: list[float], slo: SLO) -> bool:
    """A request's own ITL p99 within the target (no gaps: nothing to miss)."""
    return not itls or percentile(sorted(itls), 99) <= slo.itl_p99_s


def _good(rec: RequestRecord, itls: list[float], slo: SLO) -> bool:
    if rec.outcome != "ok" or rec.ttft_s is None or rec.ttft_s > slo.ttft_s:
        return False
    return _itl_ok(itls, slo)


def itl_misses(ok: Sequence[RequestRecord], itls: dict[int, list[float]], run: PointRun, slo: SLO) -> dict[str, int]:
    """The requests that missed their own ITL p99, and of them those whose every gap past the target this client's
    own event loop explains: a lag sample ending within the gap (or one probe period after it: the read that ended
    it was late) at least as long as the gap's excess. The server may not have caused those."""
    stalls = [(end, lag) for end, lag in zip(run.loop_lag_end_at, run.loop_lag_s) if lag > 0.001]
    missed = explained = 0
    for r in ok:
        gaps = itls[r.index]
        if _itl_ok(gaps, slo):
            continue
        missed += 1
        arrivals = [r.attempt_at + t for t in r.token_times]
        late = [(arrivals[i], arrivals[i + 1], g - slo.itl_p99_s) for i, g in enumerate(gaps) if g > slo.itl_p99_s]
        if all(any(a < e <= b + LAG_PROBE_PERIOD_S and lag >= x for e, lag in stalls) for a, b, x in late):
            explained += 1
    return {"itl_missed": missed, "itl_missed_during_client_stalls": explained}


def summarize_point(run: PointRun, slo: SLO, classes: dict[str, ClassSLO] | None = None) -> dict[str, Any]:
    recs = run.records
    ok = [r for r in recs if r.outcome == "ok"]
    itls = {r.index: request_itls(r) for r in ok}
    all_itls = [g for r in ok for g in itls[r.index]]
    tpots = [
        (r.e2e_s - r.ttft_s) / (_produced(r) - 1) for r in ok if _produced(r) > 1 and r.e2e_s and r.ttft_s is not None
    ]
    good = [r for r in ok if _good(r, itls[r.index], slo)]
    out_tokens = sum(_produced(r) for r in recs if r.outcome in ("ok", "short"))
    in_tokens = sum(r.prompt_len for r in ok)
    wall = max(run.wall_s, 1e-9)
    outcomes = Counter(r.outcome for r in recs)
    reads = sum(r.reads for r in recs)
    statuses = Counter(str(r.http_status) for r in recs if r.http_status)
    send_lag = [max(0.0, r.sent_s - r.scheduled_s) for r in recs if r.outcome != "pending"]
    rows = [_request_row(r, itls.get(r.index, [])) for r in recs]
    return {
        "requests": len(recs),
        "completed": len(ok),
        "outcomes": dict(sorted(outcomes.items())),
        "http_status": dict(sorted(statuses.items())),
        "retries_after_429": sum(r.retries for r in recs),
        # A client honouring Retry-After: of the requests refused once, how many the first retry got served.
        "retried_requests": sum(1 for r in recs if r.retries),
        "served_on_first_retry": sum(1 for r in recs if r.retries == 1 and r.outcome in ("ok", "short")),
        "refusal_ms": percentiles(s for r in recs for s in r.refusals_s),
        "wall_s": run.wall_s,
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "output_tok_per_s": out_tokens / wall,
        "total_tok_per_s": (out_tokens + in_tokens) / wall,
        "request_per_s": len(ok) / wall,
        "ttft_ms": percentiles(r.ttft_s for r in ok if r.ttft_s is not None),
        "itl_ms": percentiles(all_itls),
        "itl_p99_per_request_ms": percentiles(percentile(sorted(v), 99) for v in itls.values() if v),
        "tpot_ms": percentiles(tpots),
        "e2e_ms": percentiles(r.e2e_s for r in ok if r.e2e_s is not None),
        "arrival_gap_ms": percentiles(g for r in ok for g in _read_gaps(r)),
        "goodput": {
            "slo": {"ttft_ms": slo.ttft_s * 1e3, "itl_p99_ms": slo.itl_p99_s * 1e3},
            "fraction": len(good) / len(recs) if recs else math.nan,  # of all requests sent
            "admitted_fraction": len(good) / len(ok) if ok else math.nan,  # of those served (the 99% target's)
            "request_per_s": len(good) / wall,
        },
        "classes": summarize_classes(recs, run.wall_s, classes or {}),
        "token_counts": {
            "mismatch_vs_usage": sum(1 for r in ok if r.usage_tokens is not None and r.usage_tokens != r.tokens),
        },
        "bursts": _bursts(ok, run),
        "client": {
            "cpu_fraction": run.client_cpu_s / wall,  # of one core; near 1.0 the client is the bottleneck
            "parse_us_per_read": run.client_parse_s / reads * 1e6 if reads else math.nan,
            "loop_lag_ms": percentiles(run.loop_lag_s),
            "send_lag_ms": percentiles(send_lag),
            **itl_misses(ok, itls, run, slo),
        },
        "per_request": rows,
        # gaps over the ITL target that several requests saw at once (bench/gap_sources.py names their cause)
        "shared_gaps": shared_gap_events(rows, slo.itl_p99_s * 1e3),
    }


SHARED_GAP_MS = 10.0  # requests' longest gaps ending within this of each other are one event


def shared_gap_events(rows: list[dict[str, Any]], target_ms: float, min_streams: int = 2) -> list[dict[str, float]]:
    """Requests' longest gaps over `target_ms` grouped by when they ended (`max_gap_end_ms`, from the point's
    start): a gap every running stream saw at once is one stall upstream of them all, not each stream's own."""
    ends = sorted(
        (r["max_gap_end_ms"], r["max_gap_ms"])
        for r in rows
        if r.get("outcome") == "ok" and r.get("max_gap_ms", 0.0) > target_ms
    )
    events: list[dict[str, float]] = []
    group: list[tuple[float, float]] = []
    for end, gap in [*ends, (math.inf, 0.0)]:
        if group and end - group[0][0] > SHARED_GAP_MS:
            if len(group) >= min_streams:
                events.append(
                    {"end_ms": max(e for e, _ in group), "gap_ms": max(g for _, g in group), "streams": len(group)}
                )
            group = []
        group.append((end, gap))
    return events


def _bursts(ok: list[RequestRecord], run: PointRun) -> dict[str, Any]:
    """Whether tokens reach the client spread out or grouped, and who grouped them. Several tokens in one
    SSE event: the server grouped them. Several events in one read: either the server wrote them
    together or the client read late; a client whose event loop lagged far less than the stream's gaps
    did not read late, so then the grouping happened before the client."""
    tokens = sum(r.tokens for r in ok)
    multi_event = sum(r.tokens_in_multi_event_reads for r in ok)
    multi_token = sum(r.tokens_in_multi_token_events for r in ok)
    lag_p99 = percentile(sorted(run.loop_lag_s), 99)
    gaps = sorted(g for r in ok for g in _read_gaps(r))
    gap_p50 = percentile(gaps, 50)
    grouped = (multi_event + multi_token) / tokens if tokens else 0.0
    if grouped < 0.05:
        verdict = "streamed: tokens arrive one event at a time"
    elif multi_token >= multi_event:
        verdict = "server: several tokens per SSE event"
    elif not math.isnan(gap_p50) and lag_p99 < 0.5 * gap_p50:
        verdict = "server: several events per read while the client's loop kept up"
    else:
        verdict = "client or server: several events per read and the client's loop lagged"
    return {
        "tokens": tokens,
        "events_per_token": (sum(r.events for r in ok) / tokens) if tokens else math.nan,
        "reads_per_token": (sum(r.reads for r in ok) / tokens) if tokens else math.nan,
        "frac_tokens_in_multi_event_reads": multi_event / tokens if tokens else 0.0,
        "frac_tokens_in_multi_token_events": multi_token / tokens if tokens else 0.0,
        "verdict": verdict,
    }


def _request_row(r: RequestRecord, itls: list[float]) -> dict[str, Any]:
    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 3)

    return {
        "i": r.index,
        "in": r.prompt_len,
        "out": r.max_tokens,
        "tokens": r.tokens,
        "usage_tokens": r.usage_tokens,
        "outcome": r.outcome,
        "status": r.http_status,
        "sent_ms": ms(r.sent_s),
        "ttft_ms": ms(r.ttft_s),
        "e2e_ms": ms(r.e2e_s),
        "itl_p99_ms": ms(percentile(sorted(itls), 99)) if itls else None,
        **_largest_gap(r, itls),
        "error": r.error or None,
    }


def _largest_gap(r: RequestRecord, itls: list[float]) -> dict[str, Any]:
    """Where a request's longest token gap fell: after which output token (0 = between the first and the second) and
    when it ended, from the point's start. A request of 64-512 tokens misses its ITL p99 on one or two gaps, so these
    say whether misses sit at a point's start, behind the first token or in a burst."""
    if not itls:
        return {}
    at = max(range(len(itls)), key=itls.__getitem__)
    return {
        "max_gap_ms": round(itls[at] * 1e3, 3),
        "max_gap_after_token": at,
        "max_gap_end_ms": round((r.sent_s + r.token_times[at + 1]) * 1e3, 3),
    }
