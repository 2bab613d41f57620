"""Metrics and request timelines, end to end on CPU: a router, one prefill and one decode worker, real requests.

The cluster runs with tracing on (a test OTLP collector, tests/otlp_collector.py), so the same requests
check the histograms (router and both workers), the stage timeline route and the cross-process trace.
Plus the parts that need no cluster: the router's inter-token accumulator against prometheus-client's own
observe(), the multiprocess exposition, and the worker histograms' GB/s sanity.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.devcluster.cluster import LocalCluster
from common.observability.timeline import STAGES
from tests.helpers import running_cluster, wait_pages_back, wait_until
from tests.otlp_collector import OtlpCollector

MODEL = "smollm2-135m-instruct"
ENV = {
    "KVFERRY_NUM_PAGES": "384",
    "KVFERRY_MAX_PREFILL_TOKENS": "128",
    "KVFERRY_ROUTER_DISAGG_MIN_PROMPT_TOKENS": "32",  # the test prompts (~40 tokens) go to the prefill worker
    "OTEL_BSP_SCHEDULE_DELAY": "100",  # spans leave the processes within 0.1 s
    "KVFERRY_WARM_UP": "on",  # a GPU's default; on here too, so the start reports its warm-up phase
    "KVFERRY_LOG_LEVEL": "INFO",  # the start phases' log lines
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(snap: dict, name: str, **labels: str) -> float:
    return snap.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape(url: str) -> dict:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    return samples(r.text)


@pytest.fixture(scope="module")
def collector() -> Iterator[OtlpCollector]:
    c = OtlpCollector()
    yield c
    c.close()


@pytest.fixture(scope="module")
def cluster(collector: OtlpCollector) -> Iterator[LocalCluster]:
    with running_cluster(
        prefill=1, decode=1, env={**ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url}, wait_up=False
    ) as c:
        yield c


# One client for every request: a new httpx client builds its TLS context first (tens of ms on a busy CI box),
# which no TTFT should include.
HTTP = httpx.Client(timeout=120)


def stream_chat(router: str, content: str, max_tokens: int = 12) -> dict:
    """One streamed chat request, timed as a client sees it: its first chunk (the router starts the response
    once the first tokens are in), its first content (a token's text can wait for the next one) and the end."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    ttft = first_content = None
    rid = usage = None
    with HTTP.stream("POST", f"{router}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            if chunk.get("usage"):
                usage = chunk["usage"]
            if ttft is None:
                ttft = time.monotonic() - t0
            if first_content is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first_content = time.monotonic() - t0
    return {"id": rid, "ttft": ttft, "first_content": first_content, "e2e": time.monotonic() - t0, "usage": usage}


@pytest.fixture(scope="module")
def served(cluster: LocalCluster) -> dict:
    """Metrics before and after three disaggregated streamed requests, and what the client measured."""
    stream_chat(cluster.router_url, "Warm up the workers, please.")  # first requests pay one-off costs
    urls = {"router": cluster.router_url, "prefill": cluster.prefill_urls[0], "decode": cluster.decode_urls[0]}
    before = settled(urls)
    runs = [stream_chat(cluster.router_url, f"Describe the history of the city of Paris, part {i}.") for i in range(3)]
    after = settled(urls)
    return {"before": before, "after": after, "runs": runs}


def settled(urls: dict[str, str]) -> dict[str, dict]:
    """Every part's metrics once the requests sent so far are counted everywhere: the router has none in
    flight (it counts a request before it leaves), and each worker's engine reported its pages back, in the
    same message as its decode steps since the previous report."""
    wait_until(lambda: value(scrape(urls["router"]), "kvferry_router_inflight_requests") == 0, 30, "router idle")
    wait_pages_back(urls["prefill"], urls["decode"], timeout=30)
    return {k: scrape(u) for k, u in urls.items()}


def delta(served: dict, part: str, name: str, **labels: str) -> float:
    return value(served["after"][part], name, **labels) - value(served["before"][part], name, **labels)


def test_router_histograms_agree_with_the_client(served: dict) -> None:
    runs = served["runs"]
    assert all(r["ttft"] is not None and r["usage"] for r in runs)
    n = len(runs)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_to_dispatch_seconds"):
        assert delta(served, "router", f"kvferry_router_{name}_count") == n, name
    # The router's TTFT is the client's minus what the client itself adds (sending the request, the router
    # reading and validating it, the first chunk's way back): never more, and a small part of it (25 ms a request
    # or a tenth of the client's TTFT: on a 2-core box shared with three engines the router waits for a core, and
    # a slower box waits longer on both sides; one of them gave 29-36 ms a request of ~380 ms).
    router_ttft = delta(served, "router", "kvferry_router_time_to_first_token_seconds_sum")
    client_ttft = sum(r["ttft"] for r in runs)
    assert router_ttft <= client_ttft + 0.002 * n
    assert client_ttft - router_ttft < max(0.025 * n, 0.1 * client_ttft), (client_ttft, router_ttft)
    assert router_ttft <= sum(r["first_content"] for r in runs)
    router_e2e = delta(served, "router", "kvferry_router_e2e_request_latency_seconds_sum")
    # The router's clock stops after the last chunk is handed to the server, which may be after the client
    # read it: a waiting core's worth of slack per request (a loaded 2-core box ran 7.8 ms over for three).
    assert router_e2e <= sum(r["e2e"] for r in runs) + 0.025 * n
    assert delta(served, "router", "kvferry_router_time_to_dispatch_seconds_sum") < router_ttft
    prompt = sum(r["usage"]["prompt_tokens"] for r in runs)
    output = sum(r["usage"]["completion_tokens"] for r in runs)
    assert delta(served, "router", "kvferry_router_prompt_tokens_sum") == prompt
    squares = sum(r["usage"]["prompt_tokens"] ** 2 for r in runs)
    assert delta(served, "router", "kvferry_router_prompt_tokens_squared_total") == squares
    assert delta(served, "router", "kvferry_router_output_tokens_sum") == output
    # One gap per token after each choice's first event.
    itl = delta(served, "router", "kvferry_router_inter_token_latency_seconds_count")
    assert output - 2 * n <= itl <= output - n
    assert 0 < delta(served, "router", "kvferry_router_inter_token_latency_seconds_sum") < router_e2e
    assert delta(served, "router", "kvferry_router_requests_total", status="200", outcome="length") == n
    assert delta(served, "router", "kvferry_router_routing_decisions_total", decision="disaggregated") == n
    snap = served["after"]["router"]
    assert value(snap, "kvferry_router_worker_up", role="prefill", worker="local-prefill-0") == 1
    assert value(snap, "kvferry_router_worker_up", role="decode", worker="local-decode-0") == 1


def test_worker_histograms_count_the_requests_and_their_transfers(served: dict) -> None:
    n = len(served["runs"])
    for name in ("time_to_first_token_seconds", "remote_prefill_seconds", "request_queue_time_seconds"):
        assert delta(served, "decode", f"kvferry_{name}_count") == n, name
    steps = delta(served, "decode", "kvferry_decode_step_seconds_count")
    assert steps > 0 and delta(served, "decode", "kvferry_decode_batch_size_sum") >= steps
    # The worker's TTFT is part of the router's.
    assert delta(served, "decode", "kvferry_time_to_first_token_seconds_sum") < delta(
        served, "router", "kvferry_router_time_to_first_token_seconds_sum"
    )
    for name in ("kv_transfer_seconds", "kv_transfer_bytes", "kv_transfer_tail_seconds", "prefill_time_seconds"):
        assert delta(served, "prefill", f"kvferry_{name}_count") == n, name
    assert delta(served, "prefill", "kvferry_kv_transfer_bytes_sum") > 0
    writes = delta(served, "prefill", "kvferry_kv_transfer_speed_gb_per_s_count")
    assert writes >= n
    # Memory copies on one CPU host: no write can have gone faster than 200 GB/s.
    assert delta(served, "prefill", "kvferry_kv_transfer_speed_gb_per_s_bucket", le="200.0") == writes
    # The prefill worker's compute is inside the decode worker's wait for it.
    assert delta(served, "prefill", "kvferry_prefill_time_seconds_sum") < delta(
        served, "decode", "kvferry_remote_prefill_seconds_sum"
    )


def test_workers_report_their_start_phases(cluster: LocalCluster) -> None:
    """Each worker exports what its engine's start took, phase by phase, and logs each phase as one line: on the
    CPU the engine process's own start, the weights, the KV pool, the transfer agent and the warm-up (no kernels to
    load, no graphs to capture), which the whole start covers."""
    for role, url in (("prefill", cluster.prefill_urls[0]), ("decode", cluster.decode_urls[0])):
        snap = scrape(url)
        phases = {
            dict(labels)["phase"]: v
            for (name, labels), v in snap.items()
            if name == "kvferry_worker_start_phase_seconds"
        }
        on_cpu = {"process", "weights", "kv_pool", "transfer", "warm_up"}
        assert set(phases) == on_cpu, (role, phases)
        assert all(v >= 0 for v in phases.values()) and phases["weights"] > 0 and phases["warm_up"] > 0, phases
        assert phases["process"] > 0.5, (role, phases)  # a new interpreter that imports torch
        assert value(snap, "kvferry_worker_start_seconds") >= sum(phases.values())
        log = (cluster.log_dir / f"{role}-0.log").read_text()
        logged = {m[0]: float(m[1]) for m in re.findall(r"start phase phase=(\w+) seconds=([0-9.]+)", log)}
        assert set(logged) == on_cpu and logged["weights"] > 0 and logged["warm_up"] > 0, (role, logged)
        # The engine reports its garbage collections (common/gc_pauses.py; startup's objects are frozen, so an
        # engine may serve without one): a pause is reported exactly when a collection is.
        collections = value(snap, "kvferry_engine_gc_collections")
        pause, longest = (
            value(snap, "kvferry_engine_gc_pause_seconds"),
            value(snap, "kvferry_engine_gc_pause_max_seconds"),
        )
        assert pause >= longest >= 0 and (collections > 0) == (pause > 0), (role, collections, pause, longest)
        # exported, and 0: the CPU has no caching allocator to retry
        assert snap.get(("kvferry_engine_alloc_retries", ())) == 0, role


def test_the_timeline_route_gives_monotone_stages_of_every_process(cluster: LocalCluster, served: dict) -> None:
    rid = served["runs"][-1]["id"]
    view = httpx.get(f"{cluster.router_url}/debug/requests/{rid}", timeout=10).json()
    assert view["id"] == rid and view["status"] == 200 and view["decision"] == "disaggregated"
    stages = [s["stage"] for s in view["stages"]]
    expected = {"router_received", "tokenized", "dispatched", "decode_received", "pages_reserved"}
    expected |= {"prefill_requested", "prefill_received", "prefill_admitted", "prefill_first_token", "kv_landed"}
    expected |= {"first_token", "first_token_sent", "first_token_router", "stream_end"}
    assert expected <= set(stages), stages
    assert stages == sorted(stages, key=STAGES.index)
    times = [s["t_ms"] for s in view["stages"]]
    assert times == sorted(times), view["stages"]
    assert times[-1] == pytest.approx(view["e2e_ms"], abs=5)
    listed = httpx.get(f"{cluster.router_url}/debug/requests", timeout=10).json()["requests"]
    assert listed[0]["id"] == rid
    assert httpx.get(f"{cluster.router_url}/debug/requests/nope", timeout=10).status_code == 404


def test_one_trace_spans_router_decode_and_prefill(cluster: LocalCluster, served: dict, collector) -> None:
    rid = served["runs"][-1]["id"]
    trace_id = httpx.get(f"{cluster.router_url}/debug/requests/{rid}", timeout=10).json()["trace_id"]
    assert trace_id

    def whole_trace() -> list:
        spans = collector.trace(trace_id)
        services = {s.service for s in spans}
        whole = {"kvferry-router", "kvferry-decode", "kvferry-prefill"} <= services
        return spans if whole and any(s.name == "kv transfer" for s in spans) else []

    spans = wait_until(whole_trace, 15, "the trace's spans from all three processes", interval=0.2)
    by_name = {s.name: s for s in spans}
    root = by_name["POST /v1/chat/completions"]
    decode, prefill, transfer = by_name["decode generate"], by_name["prefill"], by_name["kv transfer"]
    assert root.parent_span_id == ""  # no traceparent from the client: the router starts the trace
    assert decode.parent_span_id == root.span_id and decode.service == "kvferry-decode"
    assert prefill.parent_span_id == decode.span_id and prefill.service == "kvferry-prefill"
    assert transfer.parent_span_id == prefill.span_id
    assert root.start_ns <= decode.start_ns <= prefill.start_ns <= transfer.start_ns <= transfer.end_ns
    assert decode.end_ns <= root.end_ns + 5_000_000
    for name in ("tokenize", "route", "wait for first token", "stream", "remote prefill and KV transfer"):
        assert name in by_name, name


# ---- without a cluster --------------------------------------------------------------------------------
def test_token_gaps_fill_the_histogram_as_observe_would() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from router.metrics import ITL_BOUNDS, RouterMetrics

    m = RouterMetrics()
    reference = Histogram("ref", "ref", buckets=ITL_BOUNDS[:-1], registry=CollectorRegistry())
    gaps = m.new_gaps()
    t = 100.0
    gaps.add(1, t)  # the first tokens: no gap
    for dt, k in ((0.0004, 1), (0.012, 2), (0.3, 1), (4.0, 3), (30.0, 1)):
        prev, t = t, t + dt
        gaps.add(k, t)
        for _ in range(k):
            reference.observe((t - prev) / k)
    m.add_gaps(gaps)
    ours = samples(generate_latest(m.registry).decode())
    for (name, labels), v in samples_of(reference).items():
        mine = name.replace("ref", "kvferry_router_inter_token_latency_seconds")
        assert ours[(mine, labels)] == pytest.approx(v), (name, labels)


def test_a_requests_itl_is_met_at_its_percentile() -> None:
    from router.metrics import RouterMetrics

    gaps = RouterMetrics().new_gaps(itl_target_s=0.05)
    t = 0.0
    gaps.add(1, t)
    for i in range(200):  # 200 gaps of 10 ms, two of them 80 ms
        t += 0.08 if i in (50, 150) else 0.01
        gaps.add(1, t)
    assert gaps.over == 2
    assert gaps.within(99.0)  # 2 of 200 above: the 99th percentile is within
    assert not gaps.within(99.5)  # 1 allowed
    t += 0.2  # a 2-token event 200 ms late: 100 ms a token, both over
    gaps.add(2, t)
    assert gaps.over == 4 and not gaps.within(99.0)


def samples_of(hist) -> dict:
    out = {}
    for fam in hist.collect():
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_several_router_processes_report_their_sum(tmp_path) -> None:
    """Multiprocess mode: two processes count, either one's exposition shows both."""
    code = """
import os, sys
from router.metrics import RouterMetrics
m = RouterMetrics()
m.requests.labels(status="200", outcome="stop").inc(int(sys.argv[1]))
m.ttft.observe(0.05)
if sys.argv[1] == "2":
    sys.stdout.write(m.exposition().decode())
"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code, "3"], env=env, check=True, cwd=os.getcwd())
    out = subprocess.run([sys.executable, "-c", code, "2"], env=env, check=True, capture_output=True, text=True)
    snap = samples(out.stdout)
    assert value(snap, "kvferry_router_requests_total", status="200", outcome="stop") == 5
    assert value(snap, "kvferry_router_time_to_first_token_seconds_count") == 2


def test_transfer_speed_is_never_taken_from_an_untimed_write() -> None:
    from prometheus_client import CollectorRegistry

    from common.worker.engine_metrics import EngineMetrics
    from common.worker.messages import TransferFigures

    m = EngineMetrics(CollectorRegistry())
    # 1 GB in 0.5 s (2 GB/s), a write that completed inside its post call (0 s: nothing measured), no bytes.
    figures = TransferFigures("decode-d", 10**9, [(10**9, 0.5), (4096, 0.0), (0, 0.1)], seconds=0.5)
    m.observe_prefill_done({}, figures)
    snap = samples_of(m.speed)
    assert snap[("kvferry_kv_transfer_speed_gb_per_s_count", ())] == 1
    assert snap[("kvferry_kv_transfer_speed_gb_per_s_sum", ())] == pytest.approx(2.0)


# ---- the dashboard and the autoscaling rules query only what is exported ----------------------------------
def exported_sample_names() -> set[str]:
    from common.worker.worker_metrics import WorkerMetrics
    from router.metrics import RouterMetrics

    names = set()
    for registry in (RouterMetrics().registry, WorkerMetrics().registry):
        for fam in registry.collect():
            names.add(fam.name + ("_total" if fam.type == "counter" else ""))  # labelled: no sample yet
            names.update(s.name for s in fam.samples)
    return names


def test_every_metric_the_dashboard_and_the_autoscalers_query_is_exported() -> None:
    import re
    import shutil
    from pathlib import Path

    import yaml

    k8s = Path(__file__).resolve().parents[1] / "k8s"
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not on PATH (.ci/run installs it); the manifests cannot be rendered")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(k8s / "overlays" / "observability")], capture_output=True, text=True, check=True
    ).stdout
    objs = [o for o in yaml.safe_load_all(rendered) if o]
    dashboards = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "kvferry-grafana-dashboard"]
    assert len(dashboards) == 1 and dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dashboards[0]["data"]["kvferry.json"])
    monitors = [o for o in objs if o["kind"] == "PodMonitor"]
    assert monitors and monitors[0]["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried.update(re.findall(r"\bkvferry_[a-z0-9_]+", target["expr"]))
    # What the custom-metrics HPAs read through prometheus-adapter.
    adapter = (k8s / "components" / "custom-metrics-autoscaling" / "prometheus-adapter-rules.yaml").read_text()
    queried.update(re.findall(r"\bkvferry_[a-z0-9_]+", adapter))
    assert len(queried) > 20
    missing = sorted(queried - exported_sample_names())
    assert not missing, f"queried but not exported: {missing}"


def test_labelled_counters_start_at_zero() -> None:
    """A fresh router and worker export their known label values at 0, so the dashboard's migration and outcome
    panels show 0 instead of "no data" until the first event."""
    from prometheus_client import generate_latest

    from common.worker.worker_metrics import WorkerMetrics
    from router.metrics import RouterMetrics

    router = samples(generate_latest(RouterMetrics().registry).decode())
    for outcome in ("started", "succeeded", "failed"):
        assert router[("kvferry_router_migrations_total", (("outcome", outcome),))] == 0.0
    for result in ("hit", "miss", "skipped"):
        assert router[("kvferry_router_prefix_lookups_total", (("result", result),))] == 0.0
    for name in ("requests", "ttft_met", "itl_met", "good", "shed"):
        for cls in ("interactive", "batch"):  # the default SLO classes (a deployment's own: declare_classes)
            assert router[(f"kvferry_router_slo_{name}_total", (("slo_class", cls),))] == 0.0
    worker = samples(generate_latest(WorkerMetrics().registry).decode())
    for outcome in ("stop", "length", "abort", "error"):
        assert worker[("kvferry_requests_total", (("outcome", outcome),))] == 0.0  # present, not defaulted
