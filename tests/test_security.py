"""Security: bearer-token auth on the router (real cluster, real HTTP), the internal token on every worker's
/internal/* routes and the password on Redis (the same cluster runs with both), secrets kept out of logs and
process arguments, the Kubernetes manifests exposing only the router (Service ports, NetworkPolicy
reachability of the workers' internal ports and of Redis), and no pickle/eval/exec/marshal on anything
a kvferry process receives (a source scan of every module that runs in the pods)."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.devcluster.cluster import LocalCluster
from common.devcluster.process import ManagedProcess, wait_ready
from common.net import free_port
from tests.helpers import assert_openai_error, running_cluster, wait_pages_back, wait_until
from tests.test_k8s_manifests import (
    NAMESPACE,
    TARGETS,
    _render,
    container,
    ingress_allowed,
    of_kind,
    one,
    pod_labels,
    resolve_port,
    role_deployments,
    selector_matches,
)
from tests.test_reliability import metric

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
SECRET = "kvf-test-secret-7f3a9c2e51d84b06"
INTERNAL_TOKEN = "kvf-internal-token-4be1c09d7a2f6e35"
REDIS_PASSWORD = "kvf-redis-password-93d0b6a1f4c8e27c"
SERVED_PACKAGES = ("common", "router", "prefill_worker", "decode_worker", "mixed_worker")
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


# ---- the router with no API key -------------------------------------------------------------------
def test_without_an_api_key_operator_routes_answer_only_loopback(smol_path) -> None:
    """With no API key, the routes that show the workers' URLs and other clients' request ids answer only a
    client on the router's host; a remote client (here: behind a proxy on this host, which uvicorn trusts to
    name it in X-Forwarded-For) gets 403, and the OpenAI routes stay open to it."""
    from common.config import RouterConfig
    from router.app import create_app
    from router.decision.discovery import StaticDiscovery
    from router.server_thread import ServerThread
    from router.settings import RouterOptions
    from router.surface.tokenizer import ModelInfo, RouterTokenizer

    worker_url = "http://10.11.12.13:8200"
    app = create_app(
        RouterConfig(api_key=None),
        RouterOptions(),
        tokenizer=RouterTokenizer.from_dir(smol_path),
        model_info=ModelInfo.from_dir(MODEL, smol_path),
        discovery=StaticDiscovery([], [worker_url]),
        use_redis=False,
    )
    remote = {"X-Forwarded-For": "203.0.113.7"}
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        rid = client.post("/v1/chat/completions", json={"messages": FRANCE}).json()  # (no worker answers)
        assert "error" in rid
        for path in ("/router/workers", "/debug/requests", "/debug/requests/chatcmpl-0"):
            r = client.get(path, headers=remote)
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["code"] == "operator_only" and worker_url not in r.text
        assert client.get("/v1/models", headers=remote).status_code == 200
        local = client.get("/router/workers")
        assert local.status_code == 200 and worker_url in local.text
        assert client.get("/debug/requests").status_code == 200


# ---- the router with an API key ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # DEBUG everywhere: the most a misconfigured pod would log.
    env = {
        "KVFERRY_LOG_LEVEL": "DEBUG",
        "KVFERRY_NUM_PAGES": "128",
        "KVFERRY_INTERNAL_TOKEN": INTERNAL_TOKEN,
        "KVFERRY_REDIS_PASSWORD": REDIS_PASSWORD,  # the cluster's own redis-server requires it
        "KVFERRY_ROUTER_DISAGG_MIN_PROMPT_TOKENS": "16",  # the prompts here go through the prefill worker
    }
    with running_cluster(prefill=1, decode=1, api_key=SECRET, env=env, wait_up=False) as c:
        yield c


def _assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, (r.status_code, r.text[:300])
    err = assert_openai_error(r.json())
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert r.headers.get("www-authenticate") == "Bearer"
    assert SECRET not in r.text


@pytest.mark.timeout(300)
def test_bearer_auth_on_every_protected_route(cluster: LocalCluster) -> None:
    url = cluster.router_url
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 2}
    protected = [
        ("GET", "/v1/models", None),
        ("GET", f"/v1/models/{MODEL}", None),
        ("POST", "/v1/chat/completions", body),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2}),
        ("GET", "/router/workers", None),
    ]
    wrong = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {SECRET[:-1]}"},  # a prefix of the key
        {"Authorization": f"Bearer {SECRET}x"},  # the key plus more
        {"Authorization": f"Bearer{SECRET}"},  # no separator
        {"Authorization": SECRET},  # no scheme
        {"Authorization": f"Basic {SECRET}"},
        {"Authorization": ""},
        {"X-Api-Key": SECRET},  # the key, but not where the router reads it
        {"Authorization": f"Bearer {SECRET}\u00e9".encode()},  # raw non-ASCII bytes
    ]
    for method, path, payload in protected:
        for headers in wrong:
            _assert_401(httpx.request(method, url + path, json=payload, headers=headers, timeout=30))
        r = httpx.request(method, url + path, json=payload, headers={"Authorization": f"Bearer {SECRET}"}, timeout=60)
        assert r.status_code == 200, (path, r.text[:300])
    # The scheme is case-insensitive and may be followed by several spaces (RFC 9110 11.4).
    for auth in (f"bearer {SECRET}", f"BEARER  {SECRET}"):
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": auth}, timeout=30)
        assert r.status_code == 200, auth
    # Unauthenticated requests are refused before the body is read or parsed: an invalid or oversized
    # body still gets 401, not 400/413.
    _assert_401(httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=10))
    _assert_401(httpx.post(f"{url}/v1/completions", content=b"x" * (9 << 20), timeout=30))
    # Probes stay open (kubelet does not carry the key).
    for path in ("/health", "/ready"):
        assert httpx.get(url + path, timeout=5).status_code == 200
    # The official client: the wrong key is an AuthenticationError, the right one works.
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2)  # type: ignore[arg-type]
    assert e.value.code == "invalid_api_key"
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=SECRET, max_retries=0, timeout=120)
    r = good.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert "Paris" in r.choices[0].message.content
    stream = good.completions.create(model=MODEL, prompt="One, two,", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in stream)


@pytest.mark.timeout(300)
def test_secret_never_logged_nor_in_process_arguments(cluster: LocalCluster) -> None:
    """The router runs at DEBUG; after authenticated, unauthenticated, failing and streamed requests, the
    key appears in no part's captured output (stdout and stderr both go to its log) nor in any command
    line (`ps` shows those to every user of the node)."""
    url = cluster.router_url
    auth = {"Authorization": f"Bearer {SECRET}"}
    httpx.get(f"{url}/v1/models", headers=auth, timeout=10)
    httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {SECRET}-wrong"}, timeout=10)
    httpx.post(f"{url}/v1/chat/completions", headers=auth, json={"messages": "bad"}, timeout=10)
    httpx.post(f"{url}/v1/chat/completions", headers=auth, json={"model": "nope", "messages": FRANCE}, timeout=10)
    httpx.post(f"{url}/v1/completions", headers=auth, json={"prompt": SECRET, "max_tokens": 2}, timeout=60)
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        headers=auth,
        json={"prompt": "Hi", "max_tokens": 2, "stream": True},
        timeout=60,
    ) as r:
        events = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    last_id = json.loads(events[0][6:])["id"]
    # Everything the parts log about these requests is written (line by line) by the time the router logs the
    # last one's timeline and the workers' requests have ended (every page back).
    router_log = cluster.log_dir / "router.log"
    wait_until(lambda: last_id in router_log.read_text(errors="replace"), 30, "the last request's timeline line")
    wait_pages_back(*cluster.prefill_urls, *cluster.decode_urls, timeout=30)
    logs = sorted(cluster.log_dir.glob("*.log"))
    assert {p.name for p in logs} >= {"router.log", "prefill-0.log", "decode-0.log"}
    router_text = router_log.read_text(errors="replace")
    assert "router starting" in router_text and "auth=True" in router_text  # DEBUG output was captured
    for path in logs:
        text = path.read_text(errors="replace")
        # The prompt we sent was the secret itself: a worker that logged prompt text would show it too.
        for secret in (SECRET, INTERNAL_TOKEN, REDIS_PASSWORD):
            assert secret not in text, f"{path.name} contains a secret"
    for part in cluster.parts:
        assert part.proc is not None
        cmdline = Path(f"/proc/{part.proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        for secret in (SECRET, INTERNAL_TOKEN, REDIS_PASSWORD):
            assert secret not in cmdline, f"{part.name}'s command line contains a secret"


# ---- the workers' internal API and Redis, closed --------------------------------------------------
INTERNAL_CALLS = [
    ("POST", "/internal/generate", {"req_id": "x1", "token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}}),
    ("POST", "/internal/prefill", {"req_id": "x2", "token_ids": [1, 2, 3], "sampling": {}, "dst_agent": "a"}),
    ("POST", "/internal/handshake", {"agent_name": "intruder"}),
    ("POST", "/internal/abort", {"req_id": "x1"}),
    ("POST", "/internal/cancel", {"dst_agent": "a", "dst_instance_id": "i", "req_ids": ["x2"]}),
    ("GET", "/internal/stats", None),
]


def _worker_counts(url: str) -> tuple[float, float]:
    """Prompt tokens received and requests finished (every outcome) by a worker."""
    return metric(url, "kvferry_prompt_tokens_total"), metric(url, "kvferry_requests_total")


@pytest.mark.timeout(300)
def test_internal_api_refuses_callers_without_the_token(cluster: LocalCluster) -> None:
    """Every /internal/* route of every worker answers 401 to a caller without the deployment's token (none,
    a wrong one, the router's API key, no scheme) and changes nothing; the probes and /metrics stay open;
    requests through the router, disaggregated ones included, go through (the router and the decode worker
    send the token)."""
    workers = cluster.prefill_urls + cluster.decode_urls
    before = {u: (_worker_counts(u), httpx.get(f"{u}/load", timeout=10).json()) for u in workers}
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {SECRET}"}]
    wrong += [{"Authorization": INTERNAL_TOKEN}, {"Authorization": f"Bearer {INTERNAL_TOKEN}x"}]
    for url in workers:
        for method, path, body in INTERNAL_CALLS:
            for headers in wrong:
                r = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=10)
                assert r.status_code == 401, (url, path, headers, r.status_code, r.text[:200])
                err = assert_openai_error(r.json())
                assert err["code"] == "invalid_internal_token"
                assert INTERNAL_TOKEN not in r.text
        for path in ("/health", "/ready", "/load", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 200, path
        token = {"Authorization": f"Bearer {INTERNAL_TOKEN}"}
        ok = httpx.post(f"{url}/internal/abort", json={"req_id": "no-such-request"}, headers=token, timeout=10)
        assert ok.status_code in (200, 204), ok.text  # with the token the route answers (nothing to abort)
    for url in workers:
        counts, load = before[url]
        assert _worker_counts(url) == counts, url  # no request was started, none finished
        now = httpx.get(f"{url}/load", timeout=10).json()
        assert now["running_requests"] == 0 and now["free_pages"] == load["free_pages"], now
    prefill = cluster.prefill_urls[0]
    done_before = _worker_counts(prefill)[1]
    auth = {"Authorization": f"Bearer {SECRET}"}
    body = {"model": MODEL, "prompt": "Count with me: one, two, three, four, five, six,", "max_tokens": 3}
    r = httpx.post(f"{cluster.router_url}/v1/completions", json=body, headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    assert _worker_counts(prefill)[1] == done_before + 1  # prefilled remotely: decode -> prefill with the token


@pytest.mark.timeout(120)
def test_the_clusters_redis_wants_the_password(cluster: LocalCluster) -> None:
    import redis

    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(cluster.redis_url, socket_timeout=5).keys("*")
    keys = redis.Redis.from_url(cluster.redis_url, password=REDIS_PASSWORD, socket_timeout=5).keys("kvf:*:hb:*")
    assert len(keys) == 2, keys  # both workers publish their prefixes with the password


# ---- Kubernetes: what is exposed ------------------------------------------------------------------
WORKER_PORTS = {"prefill": 8100, "decode": 8200, "mixed": 8300}  # docs/architecture.md "Ports, labels"


@pytest.fixture(params=sorted(TARGETS))
def objs(request) -> list[dict]:
    return list(_render(request.param))


def test_several_router_processes_reach_the_workers_with_the_secrets(cluster: LocalCluster) -> None:
    """KVFERRY_ROUTER_WORKERS=2, as the k8s router runs: each process builds its settings from what the parent
    resolved, the internal token and the Redis password included, and answers authenticated requests end to end
    (a worker refuses a router without the token, and Redis one without the password)."""
    assert cluster.router is not None
    argv = list(cluster.router.argv)
    url = f"http://127.0.0.1:{free_port()}"
    argv[argv.index("--port") + 1] = url.rsplit(":", 1)[1]
    env = dict(cluster.router.env, KVFERRY_ROUTER_WORKERS="2", KVFERRY_LOG_LEVEL="info")
    router = ManagedProcess("router-2", argv, env, cluster.log_dir / "router-2.log", url=url)
    router.start()
    try:
        wait_ready([router], 120)
        auth = {"Authorization": f"Bearer {SECRET}"}
        for i in range(6):  # a new connection each: the kernel spreads them over both processes
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 3},
                headers=auth,
                timeout=60,
            )
            assert r.status_code == 200, r.text[:300]
            assert r.json()["usage"]["completion_tokens"] >= 1
        log = (cluster.log_dir / "router-2.log").read_text()
        assert "Traceback" not in log and "processes=2" in log, log[-2000:]
        # Each process logs as the parent does (time, level, fields), at the level set in the env: each found the
        # decode worker itself.
        found = re.findall(r"^\d\d:\d\d:\d\d info kvferry[.\w]*: worker discovered role=decode ", log, re.M)
        assert len(found) >= 2, log[-2000:]
    finally:
        router.stop()


def test_router_service_exposes_only_the_router_port(objs: list[dict]) -> None:
    roles = role_deployments(objs)
    router_cont = container(roles["router"])
    workers = [r for r in WORKER_PORTS if r in roles]
    assert workers, "no worker role rendered"
    internal_ports = {resolve_port("http", container(roles[r])) for r in workers}
    for svc in of_kind(objs, "Service"):
        spec = svc["spec"]
        name = svc["metadata"]["name"]
        assert spec.get("type", "ClusterIP") == "ClusterIP", f"{name} is reachable from outside the cluster"
        assert not spec.get("externalIPs") and not spec.get("loadBalancerIP"), name
        selected = {r for r, d in roles.items() if selector_matches({"matchLabels": spec["selector"]}, pod_labels(d))}
        if "router" in selected:
            assert selected == {"router"}, f"{name} selects {selected}"
            targets = {resolve_port(p.get("targetPort", p["port"]), router_cont) for p in spec["ports"]}
            assert targets == {8000}, f"{name} forwards to {targets}: only the router's OpenAI port may be exposed"
            assert not (targets & internal_ports)
    # Workers are only ever addressed pod to pod (headless); no Ingress or Route points at them.
    for role in workers:
        assert one(objs, "Service", f"kvferry-{role}")["spec"].get("clusterIP") == "None"
    for ing in of_kind(objs, "Ingress"):
        for rule in ing["spec"].get("rules", []):
            for p in rule.get("http", {}).get("paths", []):
                assert p["backend"]["service"]["name"] == "kvferry-router", ing["metadata"]["name"]
    for deploy in of_kind(objs, "Deployment"):
        spec = deploy["spec"]["template"]["spec"]
        assert not spec.get("hostNetwork"), deploy["metadata"]["name"]
        for cont in spec["containers"]:
            assert all("hostPort" not in p for p in cont.get("ports", [])), deploy["metadata"]["name"]


def test_network_policy_keeps_internal_ports_to_kvferry_pods(objs: list[dict]) -> None:
    def pod(name: str, ns: str = NAMESPACE) -> dict:
        return {"labels": pod_labels(one(objs, "Deployment", name)), "ns": ns}

    router, redis = pod("kvferry-router"), pod("kvferry-redis")
    workers = {r: pod(f"kvferry-{r}") for r in WORKER_PORTS if r in role_deployments(objs)}
    outsiders = [
        {"labels": {"app": "debug-shell"}, "ns": NAMESPACE},  # any other pod of the namespace
        {"labels": {"app.kubernetes.io/name": "kvferry"}, "ns": NAMESPACE},  # a kvferry label, no component
        pod("kvferry-router", ns="other-team"),  # the router's labels in another namespace
        {"labels": {}, "ns": None, "ip": "203.0.113.7"},  # outside the cluster
        {"labels": {}, "ns": None, "ip": "10.0.0.5"},  # a node / in-cluster address
    ]
    # The workers' HTTP ports carry /internal/*: the router and the workers only.
    for role in workers:
        dst, port = f"kvferry-{role}", WORKER_PORTS[role]
        assert ingress_allowed(objs, router, dst, port), (dst, port)
        for src in outsiders + [redis]:
            assert not ingress_allowed(objs, src, dst, port), (src, dst, port)
    # Handshakes and prefill jobs: every pod that decodes reaches every pod that prefills for peers.
    for src in ("decode", "mixed"):
        for dst in ("prefill", "mixed"):
            if src in workers and dst in workers:
                assert ingress_allowed(objs, workers[src], f"kvferry-{dst}", WORKER_PORTS[dst]), (src, dst)
    # Redis: only kvferry's own pods.
    for src in (router, *workers.values()):
        assert ingress_allowed(objs, src, "kvferry-redis", 6379)
    for src in outsiders:
        assert not ingress_allowed(objs, src, "kvferry-redis", 6379), src
    # The router is what faces clients.
    assert ingress_allowed(objs, outsiders[3], "kvferry-router", 8000)


def test_api_key_comes_from_a_secret(objs: list[dict]) -> None:
    cont = container(role_deployments(objs)["router"])
    env = {e["name"]: e for e in cont.get("env", [])}
    entry = env.get("KVFERRY_API_KEY")
    assert entry is not None, "the router should read its key from the environment"
    assert "value" not in entry and "secretKeyRef" in entry.get("valueFrom", {}), entry
    for cm in of_kind(objs, "ConfigMap"):
        assert "KVFERRY_API_KEY" not in (cm.get("data") or {}), cm["metadata"]["name"]


# ---- no unsafe deserialization or dynamic code --------------------------------------------------
_BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "jsonpickle"}
_BANNED_CALLS = {"eval", "exec"}
# multiprocessing objects that pickle what they carry (the engine channel uses send_bytes/recv_bytes).
_PICKLING_MP = {"Queue", "SimpleQueue", "JoinableQueue", "Manager", "Listener", "Client"}
# Libraries' pickle-based entry points.
_BANNED_ATTRS = {"get_serialized_descs", "deserialize_descs", "loads_pickle"}


def _served_sources() -> list[Path]:
    files = [p for pkg in SERVED_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 30, files
    return files


def _violations(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(root)
    found = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _BANNED_MODULES:
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            if mod in _BANNED_MODULES:
                found.append(f"{where}: from {node.module} import ...")
            if mod == "multiprocessing" and any(a.name in _PICKLING_MP for a in node.names):
                found.append(f"{where}: pickling multiprocessing object")
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id in _BANNED_CALLS | {"__import__"}:
                found.append(f"{where}: {fn.id}(...)")
            if isinstance(fn, ast.Attribute):
                if fn.attr in _BANNED_CALLS and isinstance(fn.value, ast.Name) and fn.value.id == "builtins":
                    found.append(f"{where}: builtins.{fn.attr}(...)")
                if fn.attr == "recv" and not node.args and not node.keywords:
                    found.append(f"{where}: Connection.recv() unpickles; use recv_bytes()")
                if fn.attr == "load" and isinstance(fn.value, ast.Name) and fn.value.id == "torch":
                    kw = {k.arg: k.value for k in node.keywords}
                    weights_only = kw.get("weights_only")
                    if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                        found.append(f"{where}: torch.load without weights_only=True unpickles")
                if (
                    fn.attr in ("load", "unsafe_load", "full_load")
                    and isinstance(fn.value, ast.Name)
                    and fn.value.id == "yaml"
                ):
                    found.append(f"{where}: yaml.{fn.attr}")
                if fn.attr == "load" and isinstance(fn.value, ast.Name) and fn.value.id in ("np", "numpy"):
                    kw = {k.arg: k.value for k in node.keywords}
                    ap = kw.get("allow_pickle")
                    if isinstance(ap, ast.Constant) and ap.value is True:
                        found.append(f"{where}: numpy.load(allow_pickle=True)")
        elif isinstance(node, ast.Attribute):
            if node.attr in _BANNED_ATTRS:
                found.append(f"{where}: .{node.attr} (pickle-based)")
            if (
                node.attr in _PICKLING_MP
                and isinstance(node.value, ast.Name)
                and node.value.id in ("mp", "multiprocessing")
            ):
                found.append(f"{where}: multiprocessing.{node.attr} pickles")
    return found


def test_no_pickle_eval_exec_or_marshal_in_served_code() -> None:
    violations = [v for path in _served_sources() for v in _violations(path)]
    assert not violations, "\n".join(violations)


def test_the_scan_catches_what_it_looks_for(tmp_path: Path) -> None:
    """Guard against a scan that passes everything."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nfrom marshal import loads\nimport torch, yaml, builtins\n"
        "eval('1')\nexec('x = 1')\nbuiltins.eval('2')\nconn.recv()\ntorch.load('w.pt')\nyaml.load(s)\n"
        "import multiprocessing as mp\nq = mp.Queue()\nagent.get_serialized_descs(d)\n"
    )
    found = _violations(bad, tmp_path)
    assert {int(v.split(":")[1]) for v in found} == {1, 2, 4, 5, 6, 7, 8, 9, 11, 12}, found
    ok = tmp_path / "ok.py"
    ok.write_text("import json\nmodel.eval()\nconn.recv_bytes()\ntorch.load('w.pt', weights_only=True)\nsock.recv(4)\n")
    assert _violations(ok, tmp_path) == []
