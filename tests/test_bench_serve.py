"""The serving benchmark (bench/serve.py) on the packaged model, CPU: a real router, prefill and decode
worker and redis-server started as processes; and its metric definitions on hand-made timelines."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from router.server_thread import ServerThread

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
# bench/ goes after the repository root: its router.py must not shadow the router package.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.append(str(BENCH))

from serve_load import Arrivals, LoadClient, PointRun, RequestRecord, WorkItem, run_point  # noqa: E402
from serve_metrics import SLO, summarize_point  # noqa: E402
from serve_phases import parse_totals, phase_means  # noqa: E402
from serve_predictions import by_decision, served_rows, summarise  # noqa: E402
from synthetic_tokenizer import build_word_tokenizer  # noqa: E402


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent, the benchmark, has exited).
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_serve_benchmark_disaggregated_cpu(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    cmd = [
        sys.executable,
        str(BENCH / "serve.py"),
        *("--mode", "disagg", "--rates", "8", "--num", "4", "--warmup", "1"),
        *("--prompt-len", "32-64", "--output-len", "4-8", "--seed", "3"),
        # Prompts this short stay on the decode worker by default; take them through prefill -> decode.
        *("--router-env", "KVFERRY_ROUTER_DISAGG_MIN_PROMPT_TOKENS=0"),
        # Two SLO classes, with targets no CPU run misses: attainment per class, nothing shed.
        *("--class-mix", "interactive:0.5,batch:0.5"),
        *("--slo-classes", "interactive:ttft=60s,itl=30s;batch:ttft=none,itl=30s"),
        *("--out", str(out), "--no-plot"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "disagg" in proc.stdout and "rate 8" in proc.stdout  # the per-point progress line

    result = json.loads(out.read_text())
    assert result["git"]["commit"]
    assert result["client_imported_torch"] is False
    mode = result["modes"]["disagg"]
    assert mode["error"] is None and mode["roles"] == ["prefill", "decode"]
    assert mode["token_count"] == "words"  # the router streamed through the synthetic tokenizer
    (point,) = mode["points"]
    assert point["kind"] == "rate" and point["value"] == 8
    assert point["outcomes"] == {"ok": 4} and point["http_status"] == {"200": 4}
    assert point["router_decisions"] == {"disaggregated": 4}
    # the router's own record of the point's requests (bench/serve_predictions.py): all four, from its one process
    predictions = point["ttft_predictions"]
    assert predictions["requests"] == 4 and len(predictions["factors"]) == 1, predictions
    assert sum(b["n"] for b in predictions["by_predicted"]) <= 4
    assert len(predictions["served"]) == sum(b["n"] for b in predictions["by_predicted"])
    # the average request's stages across the router and both workers, in passing order
    stages = predictions["stages_ms"]
    assert list(stages)[0] == "router_received" and stages["first_token_router"]["n"] == 4, stages
    order = ["prefill_requested", "prefill_engine_received", "prefill_first_token", "kv_landed", "first_token_router"]
    assert [stages[s]["mean"] for s in order] == sorted(stages[s]["mean"] for s in order), stages
    # the workers' own stages over the point: the decode worker waited on its peer for every request, and that wait
    # holds the peer's prefill of it
    phases = point["worker_phases"]
    (prefill,) = [v for k, v in phases.items() if k.startswith("prefill")]
    (decode,) = [v for k, v in phases.items() if k.startswith("decode")]
    assert prefill["prefill"]["n"] == decode["remote_prefill"]["n"] == decode["ttft"]["n"] == 4, phases
    assert decode["ttft"]["mean_ms"] >= decode["remote_prefill"]["mean_ms"] >= prefill["prefill"]["mean_ms"] > 0
    rows = point["per_request"]
    assert all(r["tokens"] == r["out"] and 4 <= r["out"] <= 8 and 32 <= r["in"] <= 64 for r in rows)
    assert point["output_tokens"] == sum(r["out"] for r in rows)
    assert point["token_counts"]["mismatch_vs_usage"] == 0
    assert all(0 < r["ttft_ms"] <= r["e2e_ms"] for r in rows)
    # each request's longest gap, after which token and when it ended: within its own stream
    for r in rows:
        assert 0 <= r["max_gap_after_token"] <= r["out"] - 2, r
        assert r["max_gap_ms"] >= r["itl_p99_ms"] > 0, r
        assert (
            r["sent_ms"] + r["ttft_ms"] + r["max_gap_ms"]
            <= r["max_gap_end_ms"] + 0.01
            <= r["sent_ms"] + r["e2e_ms"] + 1
        ), r
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        p = point[key]
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"] <= p["max"], (key, p)
    assert point["itl_ms"]["n"] == sum(r["out"] - 1 for r in rows)
    assert point["output_tok_per_s"] > 0 and 0 <= point["goodput"]["fraction"] <= 1
    classes = point["classes"]
    assert set(classes) <= {"interactive", "batch"} and sum(c["requests"] for c in classes.values()) == 4
    assert all(c["good"] == c["requests"] and c["shed_429"] == 0 and c["attainment"] == 1 for c in classes.values())
    # Every process of the deployment is gone once the benchmark has returned.
    assert mode["pids"] and not [pid for pid in mode["pids"] if _alive(pid)]

    plotted = subprocess.run(
        [sys.executable, str(BENCH / "serve.py"), "--plot-only", str(out)], capture_output=True, text=True, timeout=120
    )
    assert plotted.returncode == 0, plotted.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in plotted.stdout
    else:
        assert (tmp_path / "serve_rate.png").stat().st_size > 0


def test_attainment_per_class_counts_shed_requests_against_their_class() -> None:
    from serve_metrics import parse_class_slos, summarize_classes

    targets = parse_class_slos("interactive:ttft=1s,itl=50ms,p=99;batch:ttft=none,itl=200ms,p=99")
    fast = [0.2 + 0.01 * k for k in range(20)]
    recs = [
        _record(0, "ok", fast),  # good
        _record(1, "ok", [1.5 + 0.01 * k for k in range(20)]),  # TTFT missed
        _record(2, "ok", [0.2, 0.21, 0.5, *[0.51 + 0.01 * k for k in range(17)]]),  # a 290 ms gap: ITL p99 missed
        _record(3, "http_429", [], status=429),
        _record(4, "ok", [9.0 + 0.1 * k for k in range(20)]),  # batch: no TTFT target, 100 ms gaps
    ]
    for r, cls in zip(recs, ["interactive"] * 4 + ["batch"], strict=True):
        r.slo_class = cls
    out = summarize_classes(recs, 10.0, targets)
    i, b = out["interactive"], out["batch"]
    assert (i["requests"], i["completed"], i["shed_429"], i["ttft_met"], i["itl_met"], i["good"]) == (4, 3, 1, 2, 2, 1)
    assert i["attainment"] == 0.25 and i["goodput_request_per_s"] == 0.1
    assert (b["requests"], b["good"], b["attainment"]) == (1, 1, 1.0) and b["targets"]["ttft_ms"] is None


def _record(i: int, outcome: str, times: list[float], status: int = 200) -> RequestRecord:
    rec = RequestRecord(i, prompt_len=100, max_tokens=len(times), outcome=outcome, http_status=status)
    rec.token_times = list(times)
    rec.tokens = len(times)
    rec.ttft_s = times[0] if times else None
    rec.e2e_s = times[-1] if times else None
    distinct = sorted(set(times))
    rec.reads = len(distinct)
    rec.events = len(distinct)
    rec.tokens_in_multi_token_events = sum(times.count(t) for t in distinct if times.count(t) > 1)
    return rec


def test_goodput_and_bursts_from_token_timelines() -> None:
    steady = _record(0, "ok", [0.100 + 0.010 * k for k in range(11)])  # 10 ms gaps: good
    late = _record(1, "ok", [3.000 + 0.010 * k for k in range(11)])  # TTFT 3 s > 2 s
    # Tokens 2-4 arrive together in one event after 100 ms: the client sees gaps of 100, 0, 0 ms.
    bursty = _record(2, "ok", [0.100, 0.110, 0.210, 0.210, 0.210, 0.220])
    refused = _record(3, "http_429", [], status=429)
    run = PointRun(
        [steady, late, bursty, refused],
        wall_s=4.0,
        loop_lag_s=[0.0001] * 10,
        client_cpu_s=0.4,
        client_parse_s=0.01,
        timed_out=0,
    )
    s = summarize_point(run, SLO(ttft_s=2.0, itl_p99_s=0.025))

    assert s["outcomes"] == {"http_429": 1, "ok": 3} and s["http_status"] == {"200": 3, "429": 1}
    assert s["goodput"]["fraction"] == 0.25  # only `steady`: one of the four requests sent
    assert s["goodput"]["request_per_s"] == 0.25
    assert s["output_tokens"] == 28 and s["output_tok_per_s"] == 7.0
    assert s["itl_ms"]["n"] == 10 + 10 + 5 and abs(s["itl_ms"]["max"] - 100.0) < 1e-6
    assert abs(s["ttft_ms"]["max"] - 3000.0) < 1e-6
    b = s["bursts"]
    assert abs(b["frac_tokens_in_multi_token_events"] - 3 / 28) < 1e-9
    assert b["verdict"].startswith("server")  # 3 of 28 tokens grouped by the server (> 5%)
    # `bursty` missed its own ITL p99 (a 100 ms gap); the client's loop did not stall then: the server's miss.
    assert s["client"]["itl_missed"] == 1 and s["client"]["itl_missed_during_client_stalls"] == 0
    # The same gap with this client's loop stalled 90 ms until just before the late read: the client's own.
    run.loop_lag_s, run.loop_lag_end_at = [0.0001, 0.090], [0.05, 0.208]
    s = summarize_point(run, SLO(ttft_s=2.0, itl_p99_s=0.025))
    assert s["client"]["itl_missed"] == 1 and s["client"]["itl_missed_during_client_stalls"] == 1


def test_synthetic_tokenizer_is_what_the_router_loads(tmp_path: Path) -> None:
    from router.surface.tokenizer import load_tokenizer

    path = build_word_tokenizer(tmp_path / "tok", vocab_size=1000, max_context=4096)
    tok, info = load_tokenizer("dummy:test", str(path))
    assert tok.vocab_size == 1000 and info.max_context == 4096 and info.name == "dummy:test"
    # Every id decodes to one word, id 0 included (no special tokens to skip).
    assert tok.decode([0, 5, 999]) == "t0 t5 t999"
    assert tok.encode("t7 t8") == [7, 8]


def test_retry_429_waits_retry_after_and_sends_again() -> None:
    """With --retry-429 a refused request waits its Retry-After and is sent again (saturation runs measure
    what admission lets through, not what it refused); without it the 429 is the outcome."""
    app = FastAPI()
    seen: list[float] = []

    @app.post("/v1/completions")
    async def completions():
        seen.append(time.monotonic())
        if len(seen) % 3 != 0:  # two refusals, then an answer
            return JSONResponse({"error": {"message": "busy"}}, status_code=429, headers={"retry-after": "0.2"})
        body = b'data: {"choices":[{"text":"t1"}]}\n\ndata: {"choices":[{"text":"t2"}]}\n\ndata: [DONE]\n\n'
        return StreamingResponse(iter([body]), media_type="text/event-stream")

    server = ServerThread(app).start()
    try:

        async def point(retry: bool) -> list[RequestRecord]:
            async with LoadClient(server.url, 10.0) as client:
                item = WorkItem(prompt_len=1, max_tokens=2, payload=b'{"prompt": [1], "max_tokens": 2}')
                run = await run_point(client, [item], Arrivals("concurrency", 1), 0, 10.0, retry_429=retry)
                return run.records

        plain = asyncio.run(point(False))
        assert plain[0].outcome == "http_429" and plain[0].retries == 0
        seen.clear()
        retried = asyncio.run(point(True))
        assert retried[0].outcome == "ok" and retried[0].retries == 2 and retried[0].tokens == 2
        assert seen[1] - seen[0] >= 0.19 and seen[2] - seen[1] >= 0.19  # Retry-After honoured
        # What the point's summary says of it: each refusal's latency, and the retry count of the served request.
        assert len(retried[0].refusals_s) == 2 and all(0 < t < 5 for t in retried[0].refusals_s)
        summary = summarize_point(PointRun(retried, 1.0, [], 0.0, 0.0, 0), SLO(1.0, 0.05))
        assert summary["retried_requests"] == 1 and summary["served_on_first_retry"] == 0
        assert summary["refusal_ms"]["n"] == 2
    finally:
        server.stop()


def test_seconds_per_point_sends_rate_times_seconds() -> None:
    """--seconds makes a Poisson point a steady state (rate x seconds requests); other points keep --num."""
    import argparse

    from serve import point_requests

    args = argparse.Namespace(num=100, seconds=20.0)
    assert point_requests(args, Arrivals("rate", 36.0)) == 720
    assert point_requests(args, Arrivals("rate", 0.01)) == 1
    assert point_requests(args, Arrivals("rate", float("inf"))) == 100
    assert point_requests(args, Arrivals("concurrency", 16)) == 100
    assert point_requests(argparse.Namespace(num=100, seconds=0.0), Arrivals("rate", 36.0)) == 100


def test_the_predictions_gathered_keep_each_request_in_arrival_order_for_a_replay() -> None:
    """A point's router records become [received s after the start, predicted ms, measured ms, prompt tokens] in
    arrival order (what a replay through the error factor reads), beside the buckets of measured / predicted."""
    records = [
        {"received_at": 1002.5, "predicted_ttft_ms": 400.0, "ttft_ms": 900.0, "prompt_tokens": 3000},
        {"received_at": 1000.25, "predicted_ttft_ms": 80.0, "ttft_ms": 60.0, "prompt_tokens": 512},
    ]
    assert served_rows(records, 1000.0) == [[0.25, 80.0, 60.0, 512], [2.5, 400.0, 900.0, 3000]]
    buckets = summarise([(r["predicted_ttft_ms"], r["ttft_ms"]) for r in records])
    assert [(b["predicted_ms"], b["n"], b["ratio"]["p50"]) for b in buckets] == [
        ([0.0, 100.0], 1, 0.75),
        ([250.0, 500.0], 1, 2.25),
    ]


def test_a_points_collections_and_slow_ones_are_read_beside_the_stages() -> None:
    """Each process's garbage collections over a point, from the histograms (HTTP side, router) and the engine's
    gauges: how many, their mean, and how many took 30 ms or more (a gap every stream they relay shares)."""

    def exposition(http: tuple[float, int, int], engine: tuple[float, int]) -> str:
        seconds, count, within = http
        return "\n".join(
            [
                "# HELP kvferry_worker_gc_pause_seconds Each garbage collection of the worker's HTTP process",
                f'kvferry_worker_gc_pause_seconds_bucket{{le="0.02"}} {within}',
                f'kvferry_worker_gc_pause_seconds_bucket{{le="0.03"}} {within}',
                f'kvferry_worker_gc_pause_seconds_bucket{{le="+Inf"}} {count}',
                f"kvferry_worker_gc_pause_seconds_sum {seconds}",
                f"kvferry_worker_gc_pause_seconds_count {count}",
                f"kvferry_engine_gc_pause_seconds {engine[0]}",
                f"kvferry_engine_gc_collections {engine[1]}",
                "kvferry_request_queue_time_seconds_sum 1.5",
                "kvferry_request_queue_time_seconds_count 3",
                f'kvferry_slow_steps_total{{cause="stall"}} {engine[1] // 20}',
                'kvferry_slow_steps_total{cause="chunk"} 4.0',
                f"kvferry_engine_alloc_retries {engine[1] // 60}",
            ]
        )

    before = {"decode-0": parse_totals(exposition((0.010, 10, 10), (0.004, 40)))}
    after = {"decode-0": parse_totals(exposition((0.090, 12, 11), (0.010, 60)))}  # one of 77 ms, one of 3 ms
    phases = phase_means(before, after)["decode-0"]
    assert phases["gc_http"] == {"mean_ms": 40.0, "n": 2}
    assert phases["gc_http_over_30ms"] == {"n": 1}
    assert phases["gc_engine"] == {"mean_ms": 0.3, "n": 20}
    assert "gc_engine_over_30ms" not in phases and "queue" not in phases  # gauges have no buckets; no new queue
    assert phases["slow_steps_stall"] == {"n": 1} and "slow_steps_chunk" not in phases  # a count, by its label
    assert phases["alloc_retries"] == {"n": 1}


def test_predictions_by_decision_say_which_path_came_later_than_predicted() -> None:
    records = [
        {"decision": "adaptive-local", "predicted_ttft_ms": 100.0, "ttft_ms": 120.0},
        {"decision": "adaptive-disaggregated", "predicted_ttft_ms": 100.0, "ttft_ms": 190.0},
        {"decision": "adaptive-disaggregated", "predicted_ttft_ms": 200.0, "ttft_ms": 250.0},
    ]
    assert by_decision(records) == {
        "adaptive-disaggregated": {"n": 2, "excess_ms": {"p50": 90.0, "p90": 90.0}},
        "adaptive-local": {"n": 1, "excess_ms": {"p50": 20.0, "p90": 20.0}},
    }
