"""bench/gap_sources.py: a token gap many requests shared, lined up with the engine's step trace and named."""

from __future__ import annotations

import json

from bench.gap_sources import main


def _request(i: int, gap_ms: float, end_ms: float) -> dict:
    return {"i": i, "outcome": "ok", "max_gap_ms": gap_ms, "max_gap_end_ms": end_ms, "max_gap_after_token": 9}


def _step(t: float, kind: str, tokens: int, rows: int, device_ms: float, gap_ms: float, launch_ms: float) -> dict:
    return {
        "t": t,
        "kind": kind,
        "prefill_tokens": tokens,
        "decode_rows": rows,
        "device_s": device_ms / 1e3,
        "gap_s": gap_ms / 1e3,
        "launch_host_s": launch_ms / 1e3,
        "process_host_s": 0.0005,
    }


def test_shared_gaps_are_named_by_the_step_that_ended_them(tmp_path, capsys) -> None:
    start = 1000.0
    requests = [_request(i, 62.0, 2000.0 + i) for i in range(5)]  # an eager launch at 2.0 s: 5 streams
    requests += [_request(5 + i, 58.0, 4000.0 + i) for i in range(3)]  # a host stall at 4.0 s: 3 streams
    requests += [_request(8 + i, 61.0, 6000.0) for i in range(4)]  # a long device step at 6.0 s
    requests += [_request(12 + i, 70.0, 8000.0) for i in range(2)]  # nothing in the engine at 8.0 s
    requests += [_request(14, 90.0, 9000.0), _request(15, 30.0, 9500.0)]  # one stream alone, or under the target
    serve = {"modes": {"agg@fp8": {"points": [{"value": 30.0, "started_at": start, "per_request": requests}]}}}
    steps = [
        _step(start + 1.995, "decode", 0, 40, 6.0, 60.0, 2.0),
        _step(start + 2.030, "mixed", 2048, 40, 35.0, 12.0, 52.0),  # launched during the gap above, eagerly
        _step(start + 3.995, "decode", 0, 40, 6.0, 57.0, 2.0),
        _step(start + 4.030, "mixed", 1024, 40, 20.0, 12.0, 10.0),
        _step(start + 5.998, "mixed", 2048, 40, 58.0, 59.0, 14.0),
        _step(start + 7.998, "decode", 0, 40, 6.0, 6.2, 2.0),
    ]
    (tmp_path / "serve.json").write_text(json.dumps(serve))
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    out = tmp_path / "gaps.json"
    argv = [str(tmp_path / "serve.json"), "--mode", "agg@fp8", "--trace", str(tmp_path / "steps.jsonl")]
    assert main([*argv, "--graphed-tokens", "2048", "--out", str(out)]) == 0
    events = json.loads(out.read_text())["events"]
    assert [(e["streams"], e["cause"]) for e in events] == [
        (5, "eager launch"),
        (3, "host"),
        (4, "device"),
        (2, "downstream"),
    ]
    assert events[0]["next_step"]["prefill_tokens"] == 2048 and events[3]["step"] is None
    launches = json.loads(out.read_text())["launch_ms"]
    assert launches["mixed (eager)"]["n"] == 2 and launches["mixed (graphed)"]["n"] == 1
    assert "eager launch" in capsys.readouterr().out
    # with graphs covering the step, the same launch is host time, not an eager one
    assert main([*argv, "--graphed-tokens", "2560", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["events"][0]["cause"] == "host"
    assert main([*argv[:1], "--mode", "agg", *argv[3:]]) == 2  # a mode the run lacks: said, not a traceback
    assert "no mode 'agg'" in capsys.readouterr().err


def test_a_downstream_gap_is_named_by_a_slow_collection_the_logs_place_in_it(tmp_path, capsys) -> None:
    """--logs: a process's slow garbage collection that ran while the streams waited (the log line's `at`, when it
    ended) names a gap the engine's steps do not explain; one at another time, or a line without `at`, does not."""
    start = 1000.0
    requests = [_request(i, 70.0, 8000.0) for i in range(3)] + [_request(3 + i, 65.0, 9000.0) for i in range(2)]
    serve = {"modes": {"agg@fp8": {"points": [{"value": 30.0, "started_at": start, "per_request": requests}]}}}
    steps = [_step(start + 7.998, "decode", 0, 40, 6.0, 6.2, 2.0), _step(start + 8.998, "decode", 0, 40, 6.0, 6.2, 2.0)]
    (tmp_path / "serve.json").write_text(json.dumps(serve))
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    logs = tmp_path / "logs" / "fp8"
    logs.mkdir(parents=True)
    slow = "12:00:00 warning kvferry.gc: slow garbage collection generation=2 ms={ms} collected=0{at}\n"
    (logs / "agg-router.log").write_text(
        slow.format(ms=64.1, at=f" at={start + 7.995}")  # ended inside the first gap
        + slow.format(ms=30.0, at=f" at={start + 5.0}")  # long before either
        + slow.format(ms=40.0, at="")  # an older line: no time to place it
    )
    (logs / "agg-decode-0.log").write_text(slow.format(ms=21.0, at=f" at={start + 7.990}"))
    out = tmp_path / "gaps.json"
    argv = [str(tmp_path / "serve.json"), "--mode", "agg@fp8", "--trace", str(tmp_path / "steps.jsonl")]
    assert main([*argv, "--logs", str(tmp_path / "logs"), "--out", str(out)]) == 0
    events = json.loads(out.read_text())["events"]
    assert [(e["streams"], e["cause"]) for e in events] == [(3, "collection"), (2, "downstream")]
    assert events[0]["collection"]["log"] == "fp8/agg-router.log" and events[0]["collection"]["ms"] == 64.1
    assert "collection in fp8/agg-router.log: generation 2, 64.1 ms" in capsys.readouterr().out
