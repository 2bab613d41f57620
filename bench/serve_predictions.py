"""The router's TTFT predictions against what its requests measured, gathered after a load point.

Admission sheds a request whose predicted TTFT, scaled by the process's error factor
(router/decision/ttft_error.py), passes its class's target; a factor at its ceiling sheds twice as early as the
prediction says. Where the error comes from decides the fix: ratios that grow as predictions shrink say the error
is additive (a wait the prediction leaves out, such as another router process's placements since the last load
poll), ratios flat across predictions say the step model is off by a factor. Each router process keeps its own
recent requests and factor, and a GET reaches whichever process accepts it, so the gatherer asks several times and
merges by request id and process id.
"""

from __future__ import annotations

from typing import Any

from serve_deploy import get_json

# Predicted-TTFT buckets (ms, upper edges) the ratios are summarised by: the decision's edge sits between
# target / MAX_FACTOR and the target, the fixed costs below.
BUCKETS_MS = (100.0, 250.0, 500.0, 1000.0, float("inf"))
ASKS = 12  # GETs per endpoint: with two processes behind one port, both answer within a few


def gather_predictions(url: str, since_wall_s: float, limit: int) -> dict[str, Any]:
    """Requests received since `since_wall_s` (wall clock) with their predicted and measured TTFT, summarised, and
    each answering process's error factor."""
    records: dict[str, dict[str, Any]] = {}
    factors: dict[str, float] = {}
    remote_excess: dict[str, float] = {}
    for _ in range(ASKS):
        body = get_json(f"{url}/debug/requests?limit={limit}&stages=1", 5.0) or {}
        for r in body.get("requests", []):
            if (r.get("received_at") or 0.0) >= since_wall_s and r.get("id"):
                records[r["id"]] = r
        view = get_json(f"{url}/router/workers", 5.0) or {}
        if "process" in view:
            factors[str(view["process"])] = view.get("ttft_error_factor", 1.0)
            remote_excess[str(view["process"])] = view.get("remote_prefill_excess_s", 0.0)
    kept = [r for r in records.values() if r.get("predicted_ttft_ms") and r.get("ttft_ms") is not None]
    return {
        "requests": len(records),
        "factors": factors,
        "remote_excess_s": remote_excess,
        "by_predicted": summarise([(r["predicted_ttft_ms"], r["ttft_ms"]) for r in kept]),
        "by_decision": by_decision(kept),
        "served": served_rows(kept, since_wall_s),
        "stages_ms": stage_means([r for r in records.values() if r.get("ttft_ms") is not None]),
    }


def stage_means(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each stage's mean time since the router received the request (common/observability/timeline.py: the router's,
    the decode worker's and its prefill peer's stamps), in passing order, over the requests that reached it: where
    an average first token spends its time, across processes."""
    by_stage: dict[str, list[float]] = {}
    for r in records:
        for row in r.get("stages") or []:
            by_stage.setdefault(row["stage"], []).append(row["t_ms"])
    means = {stage: {"mean": round(sum(v) / len(v), 2), "n": len(v)} for stage, v in by_stage.items()}
    return dict(sorted(means.items(), key=lambda kv: kv[1]["mean"]))


def by_decision(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per placement reason (adaptive-local, adaptive-disaggregated, ...): how many, and measured - predicted TTFT
    (ms) at p50 / p90, as placed (a remote prediction with the router's remote excess in it,
    router/decision/remote_excess.py). Where one path's excess stays above the other's, placement ranks them wrong."""
    groups: dict[str, list[float]] = {}
    for r in records:
        groups.setdefault(r.get("decision") or "-", []).append(r["ttft_ms"] - r["predicted_ttft_ms"])
    return {
        name: {"n": len(v), "excess_ms": {f"p{q}": round(_at(sorted(v), q), 1) for q in (50, 90)}}
        for name, v in sorted(groups.items())
    }


def served_rows(records: list[dict[str, Any]], since_wall_s: float) -> list[list[Any]]:
    """Each request as [received (s after the point's start), predicted ms, measured ms, prompt tokens], in arrival
    order: enough to replay a run through router/decision/ttft_error.py offline."""
    rows = [
        [round(r["received_at"] - since_wall_s, 3), r["predicted_ttft_ms"], r["ttft_ms"], r.get("prompt_tokens")]
        for r in records
    ]
    return sorted(rows, key=lambda row: row[0])


def summarise(pairs: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Per predicted-TTFT bucket: how many, measured / predicted at p50 / p90 / p99, and measured - predicted (ms)."""
    out = []
    low = 0.0
    for high in BUCKETS_MS:
        inside = [(p, m) for p, m in pairs if low <= p < high]
        if inside:
            ratios = sorted(m / p for p, m in inside)
            excess = sorted(m - p for p, m in inside)
            out.append(
                {
                    "predicted_ms": [low, None if high == float("inf") else high],
                    "n": len(inside),
                    "ratio": {f"p{q}": round(_at(ratios, q), 3) for q in (50, 90, 99)},
                    "excess_ms": {f"p{q}": round(_at(excess, q), 1) for q in (50, 90, 99)},
                }
            )
        low = high
    return out


def _at(ordered: list[float], q: int) -> float:
    """Nearest rank, as the router takes its error factor (router/decision/ttft_error.py): the two compare."""
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]
