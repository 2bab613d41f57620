"""`kvferry planner` end to end without a cluster: it reads a router's real metrics text and workers view over
HTTP, decides, and patches the Deployments' scale through the real kubernetes client against an HTTP server
speaking the scale subresource (what is real: the router's metrics and placement view, HTTP, the kubernetes
client and its requests; what is not: the API server, a stand-in that records what it is sent). A dry run
never reaches the API server."""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from kubernetes import client as k8s

from common.capacity import StepCost
from planner.core import Planner, PlannerConfig
from planner.main import PlannerMetrics, build_parser, build_planner, step
from planner.scaler import DeploymentScaler, DryRun
from planner.sizing import Counts, FleetSpec
from router.decision.load import parse_load
from router.decision.policy import RoutingPolicy
from router.decision.pool import WorkerPool
from router.metrics import RouterMetrics
from router.runtime import placement_inputs
from router.timeline import RequestLog

COEF = {"base_s": 0.004, "per_prefill_token_s": 25e-6, "per_decode_row_s": 20e-6, "per_context_token_s": 5e-8}


class Backend:
    """One router (its real metrics and pool) and one API server stand-in, on one HTTP server."""

    def __init__(self) -> None:
        self.metrics = RouterMetrics()
        self.pool = WorkerPool(client=None)  # type: ignore[arg-type]
        self.replicas = {"kvferry-prefill": 1, "kvferry-decode": 1}
        self.api_calls: list[tuple[str, str, dict | None]] = []
        for role, url in (("prefill", "http://p0"), ("decode", "http://d0")):
            self.pool.set_targets(role, [url])
            self.queue(role, 0)

    def queue(self, role: str, tokens: int) -> None:
        url = "http://p0" if role == "prefill" else "http://d0"
        load = {
            "role": role, "pod": f"{role}-0", "ready": True, "queued_prefill_tokens": tokens,
            "prefill_tokens_per_s": 40_000.0, "step_coefficients": COEF, "total_pages": 50_000, "free_pages": 50_000,
        }  # fmt: skip
        self.pool.report_load(self.pool.workers[url], parse_load(load))

    def serve(self, n: int, prompt: int, output: int) -> None:
        for _ in range(n):
            self.metrics.requests.labels(status="200", outcome="stop").inc()
            self.metrics.prompt_tokens.observe(prompt)
            self.metrics.output_tokens.observe(output)


@pytest.fixture
def backend() -> Iterator[tuple[Backend, str]]:
    b = Backend()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, body: bytes, kind: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _scale(self, name: str) -> bytes:
            return json.dumps(
                {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": "kvferry"},
                 "spec": {"replicas": b.replicas[name]}, "status": {"replicas": b.replicas[name]}}
            ).encode()  # fmt: skip

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(b.metrics.exposition(), "text/plain")
            elif self.path == "/router/workers":
                self._send(json.dumps({"placement": placement_inputs(b.pool, RoutingPolicy())}).encode())
            else:
                name = self.path.split("/deployments/")[1].split("/")[0]
                b.api_calls.append(("GET", name, None))
                self._send(self._scale(name))

        def do_PATCH(self) -> None:
            name = self.path.split("/deployments/")[1].split("/")[0]
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            b.api_calls.append(("PATCH", name, body))
            b.replicas[name] = body["spec"]["replicas"]
            self._send(self._scale(name))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield b, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def _planner() -> Planner:
    spec = FleetSpec(cost=StepCost(), ttft_s=1.0, itl_s=0.05, chunk_tokens=2048, min_workers=Counts(1, 1, 0))
    return Planner(spec, PlannerConfig(interval_s=5.0))


def _run(b: Backend, url: str, scaler) -> list:  # type: ignore[no-untyped-def]
    """Two readings 10 s apart: 1,000 requests of 2,000 / 300 tokens between them (100 req/s)."""
    planner, history, metrics = _planner(), deque(), PlannerMetrics()
    planner.targets = Counts(1, 1, 0)
    with httpx.Client() as http:
        first = step(planner, http, [url], history, 60.0, scaler, metrics, now=0.0)
        b.serve(1000, 2000, 300)
        second = step(planner, http, [url], history, 60.0, scaler, metrics, now=10.0)
    return [first, second, metrics]


def test_dry_run_decides_and_exports_but_never_reaches_the_api_server(backend) -> None:
    b, url = backend
    first, second, metrics = _run(b, url, DryRun())
    assert first is None  # one reading: no rate yet
    assert second.targets.prefill >= 6 and second.targets.decode >= 5  # the sizing of 100 req/s (test_planner_core)
    assert metrics.desired.labels(role="prefill")._value.get() == second.targets.prefill
    assert b.api_calls == [] and b.replicas == {"kvferry-prefill": 1, "kvferry-decode": 1}


def test_live_run_patches_each_deployments_scale(backend) -> None:
    b, url = backend
    api = k8s.AppsV1Api(k8s.ApiClient(k8s.Configuration(host=url)))
    scaler = DeploymentScaler(api, "kvferry", {"prefill": "kvferry-prefill", "decode": "kvferry-decode"})
    assert scaler.current() == {"prefill": 1, "decode": 1}
    _, second, _ = _run(b, url, scaler)
    patches = [(name, body) for verb, name, body in b.api_calls if verb == "PATCH"]
    assert patches == [
        ("kvferry-prefill", {"spec": {"replicas": second.targets.prefill}}),
        ("kvferry-decode", {"spec": {"replicas": second.targets.decode}}),
    ]
    assert b.replicas == {"kvferry-prefill": second.targets.prefill, "kvferry-decode": second.targets.decode}


def test_a_growing_queue_at_the_router_raises_prefill(backend) -> None:
    b, url = backend
    b.queue("prefill", 40_000 * 3)  # 3 s of prompts queued on the only prefill worker, alarm at 0.5 s
    planner, history, metrics = _planner(), deque(), PlannerMetrics()
    planner.targets = Counts(1, 1, 0)
    with httpx.Client() as http:
        step(planner, http, [url], history, 60.0, DryRun(), metrics, now=0.0)
        b.serve(10, 2000, 300)  # 1 req/s: the rate alone needs one worker of each
        d = step(planner, http, [url], history, 60.0, DryRun(), metrics, now=10.0)
    assert d.targets.prefill == 2 and d.reasons["prefill"] == "up 1->2" and d.targets.decode == 1
    assert metrics.wait._value.get() == pytest.approx(3.0)


def test_requests_still_in_the_router_count_as_arrivals(backend) -> None:
    b, url = backend
    planner, history, metrics = _planner(), deque(), PlannerMetrics()
    planner.targets = Counts(1, 1, 0)
    log = RequestLog(b.metrics)
    with httpx.Client() as http:
        step(planner, http, [url], history, 60.0, DryRun(), metrics, now=0.0)
        b.serve(10, 2000, 300)
        for _ in range(40):  # arrived, not finished: queued behind a saturated fleet
            log.begin(True, None, "/v1/completions")
        step(planner, http, [url], history, 60.0, DryRun(), metrics, now=10.0)
    assert metrics.rate._value.get() == pytest.approx(5.0)  # 50 arrivals in 10 s, not the 10 that finished


def test_flags_parse() -> None:
    args = build_parser().parse_args(
        ["--dry-run", "--routers", "http://r:8000", "--deployments", "mixed=kvferry-mixed"]
    )
    assert args.dry_run and args.routers == "http://r:8000" and args.deployments == "mixed=kvferry-mixed"


def test_the_step_reserve_flag_reaches_the_planner() -> None:
    base = ["--slo", "interactive:ttft=1s,itl=50ms"]
    assert build_planner(build_parser().parse_args(base)).cfg.step_reserve == 0.0
    assert build_planner(build_parser().parse_args([*base, "--step-reserve", "1"])).cfg.step_reserve == 1.0


def test_the_k8s_planner_runs_with_the_step_reserve_it_was_evaluated_with() -> None:
    """k8s/components/planner's args parse as the CLI's and ride out a doubling (bench/RESULTS.md, "Planner")."""
    from pathlib import Path

    import yaml

    manifest = Path(__file__).resolve().parents[1] / "k8s/components/planner/planner.yaml"
    deploy = next(d for d in yaml.safe_load_all(manifest.read_text()) if d and d["kind"] == "Deployment")
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "planner"
    assert build_planner(build_parser().parse_args(args[1:])).cfg.step_reserve == 1.0
