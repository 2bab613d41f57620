"""Kubernetes discovery through the real `kubernetes` client against a local server that speaks enough of
the pod list/watch API: PodList with a resourceVersion, chunked watch streams of JSON events, server-side
watch timeouts, and "410 Gone" for versions too old to resume from."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client as k8s_client

from common.net import free_port
from router.decision.discovery import KubernetesDiscovery, pod_url
from tests.helpers import wait_until

NS = "kvf"


class FakeKube:
    """Pods of one namespace, a resourceVersion counter, an event log, and live watch streams."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rv = 100
        self.pods: dict[str, dict[str, Any]] = {}
        self.log: list[tuple[int, str, dict[str, Any]]] = []
        self.watches: list[queue.Queue[tuple[int, str, dict[str, Any]] | None]] = []
        self.oldest_rv = 0  # watches from before this version get 410
        self.deliver = True  # False: events are logged but live watches do not see them
        self.list_calls = 0
        self.watch_calls = 0
        self.watched: list[str] = []  # each watch call's label selector, in order

    # ---- state changes (test side) ---------------------------------------------------------------
    def _emit(self, kind: str, pod: dict[str, Any]) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        snapshot = json.loads(json.dumps(pod))
        self.log.append((self.rv, kind, snapshot))
        if self.deliver:
            for q in self.watches:
                q.put((self.rv, kind, snapshot))

    def add_pod(
        self,
        name: str,
        component: str,
        ip: str | None = None,
        ready: bool = False,
        port_name: str | None = None,
        app: str = "kvferry",
    ) -> None:
        ports = [{"name": port_name, "containerPort": 9000, "protocol": "TCP"}] if port_name else []
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NS,
                "uid": f"uid-{name}",
                "labels": {"app.kubernetes.io/name": app, "app.kubernetes.io/component": component},
            },
            "spec": {"containers": [{"name": "worker", "image": "kvferry", "ports": ports}]},
            "status": {"phase": "Running" if ip else "Pending", "podIP": ip, "conditions": []},
        }
        self._set_ready(pod, ready)
        with self.lock:
            self.pods[name] = pod
            self._emit("ADDED", pod)

    @staticmethod
    def _set_ready(pod: dict[str, Any], ready: bool) -> None:
        pod["status"]["conditions"] = [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ]

    def modify(self, name: str, *, ip: str | None = None, ready: bool | None = None, terminating: bool = False) -> None:
        with self.lock:
            pod = self.pods[name]
            if ip is not None:
                pod["status"]["podIP"] = ip
                pod["status"]["phase"] = "Running"
            if ready is not None:
                self._set_ready(pod, ready)
            if terminating:
                pod["metadata"]["deletionTimestamp"] = "2026-11-29T10:00:00Z"
            self._emit("MODIFIED", pod)

    def delete(self, name: str) -> None:
        with self.lock:
            pod = self.pods.pop(name)
            self._emit("DELETED", pod)

    def expire(self) -> None:
        """Compact history: every live watch gets a 410 ERROR and resuming from old versions fails."""
        with self.lock:
            self.oldest_rv = self.rv + 1
            for q in self.watches:
                q.put((0, "EXPIRE", {}))

    # ---- API side ---------------------------------------------------------------------------------
    @staticmethod
    def matches(pod: dict[str, Any], selector: str) -> bool:
        labels = pod["metadata"].get("labels") or {}
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    def pod_list(self, selector: str) -> dict[str, Any]:
        with self.lock:
            self.list_calls += 1
            items = [p for p in self.pods.values() if self.matches(p, selector)]
            return {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": items,
            }


def gone_event() -> dict[str, Any]:
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": "too old resource version",
            "reason": "Expired",
            "code": 410,
        },
    }


def make_handler(kube: FakeKube) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            url = urlparse(self.path)
            if url.path != f"/api/v1/namespaces/{NS}/pods":
                self.send_error(404)
                return
            q = {k: v[0] for k, v in parse_qs(url.query).items()}
            selector = q.get("labelSelector", "")
            if q.get("watch") not in ("true", "True", "1"):
                body = json.dumps(kube.pod_list(selector)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.watch(selector, int(q.get("resourceVersion") or 0), float(q.get("timeoutSeconds") or 30))

        def chunk(self, obj: dict[str, Any]) -> None:
            data = (json.dumps(obj) + "\n").encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def watch(self, selector: str, since: int, timeout_s: float) -> None:
            inbox: queue.Queue[tuple[int, str, dict[str, Any]] | None] = queue.Queue()
            with kube.lock:
                kube.watch_calls += 1
                kube.watched.append(selector)
                expired = since < kube.oldest_rv
                backlog = [] if expired else [e for e in kube.log if e[0] > since]
                if not expired:
                    kube.watches.append(inbox)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                if expired:
                    self.chunk(gone_event())
                    return
                for _rv, kind, pod in backlog:
                    if kube.matches(pod, selector):
                        self.chunk({"type": kind, "object": pod})
                deadline = time.monotonic() + timeout_s
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        item = inbox.get(timeout=min(left, 0.2))
                    except queue.Empty:
                        continue
                    if item is None:
                        return
                    _rv, kind, pod = item
                    if kind == "EXPIRE":
                        self.chunk(gone_event())
                        return
                    if kube.matches(pod, selector):
                        self.chunk({"type": kind, "object": pod})
            except (BrokenPipeError, ConnectionResetError):
                return
            finally:
                with kube.lock:
                    if inbox in kube.watches:
                        kube.watches.remove(inbox)
                try:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except OSError:
                    pass

    return Handler


class ApiServer:
    def __init__(self, kube: FakeKube, port: int | None = None) -> None:
        self.port = port or free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), make_handler(kube))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Seen:
    """The latest URL set per role, as discovery reported it (called from discovery's threads)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.urls: dict[str, set[str] | None] = {"prefill": None, "decode": None}

    def __call__(self, role: str, urls: set[str]) -> None:
        with self.cond:
            self.urls[role] = set(urls)
            self.cond.notify_all()

    def wait(self, pred: Callable[[dict[str, set[str] | None]], bool], timeout_s: float = 10.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: pred(self.urls), timeout_s):
                raise AssertionError(f"discovery did not converge; last seen {self.urls}")

    def expect(self, prefill: set[str], decode: set[str], timeout_s: float = 10.0) -> None:
        self.wait(lambda u: u["prefill"] == prefill and u["decode"] == decode, timeout_s)


@pytest.fixture
def cluster() -> Iterator[tuple[FakeKube, ApiServer, Seen, KubernetesDiscovery]]:
    kube = FakeKube()
    server = ApiServer(kube)
    cfg = k8s_client.Configuration()
    cfg.host = f"http://127.0.0.1:{server.port}"
    seen = Seen()
    disc = KubernetesDiscovery(
        NS, api_client=k8s_client.ApiClient(cfg), watch_timeout_s=2, request_timeout_s=5.0, max_backoff_s=0.3
    )
    disc.start(seen)
    try:
        yield kube, server, seen, disc
    finally:
        disc.stop()
        server.stop()


def wait_watched(disc: KubernetesDiscovery, role: str, names: set[str], timeout_s: float = 10.0) -> None:
    """Returns once `role`'s watcher has taken in an event for each pod of `names` (routable or not)."""
    watcher = next(w for w in disc.watchers if w.role == role)
    deadline = time.monotonic() + timeout_s
    while not names <= set(watcher.pods):
        assert time.monotonic() < deadline, f"the {role} watch did not deliver {names}; it holds {watcher.pods}"
        time.sleep(0.02)


def test_pods_added_ready_ip_change_deleted(cluster) -> None:
    kube, _server, seen, disc = cluster
    seen.expect(set(), set())
    kube.add_pod("pf-0", "prefill")  # pending, no IP: not routable
    kube.add_pod("dc-0", "decode", ip="10.0.1.1", ready=False)
    kube.add_pod("router-0", "router", ip="10.0.9.9", ready=True)  # other component: ignored
    kube.add_pod("other-0", "prefill", ip="10.0.8.8", ready=True, app="someone-else")  # other app: ignored
    wait_watched(disc, "prefill", {"pf-0"})  # delivered, so what follows is a verdict, not a race
    wait_watched(disc, "decode", {"dc-0"})
    assert seen.urls["prefill"] == set() and seen.urls["decode"] == set()
    assert all(set(w.pods) <= {"pf-0", "dc-0"} for w in disc.watchers)  # the router's and other app's pods
    kube.modify("pf-0", ip="10.0.0.1")
    kube.modify("pf-0", ready=True)
    kube.modify("dc-0", ready=True)
    seen.expect({"http://10.0.0.1:8100"}, {"http://10.0.1.1:8200"})
    kube.add_pod("dc-1", "decode", ip="10.0.1.2", ready=True, port_name="http")  # named port wins
    seen.expect({"http://10.0.0.1:8100"}, {"http://10.0.1.1:8200", "http://10.0.1.2:9000"})
    kube.modify("pf-0", ip="10.0.0.7")  # rescheduled with a new IP
    seen.expect({"http://10.0.0.7:8100"}, {"http://10.0.1.1:8200", "http://10.0.1.2:9000"})
    kube.modify("dc-1", ready=False)  # failing readiness: out
    seen.expect({"http://10.0.0.7:8100"}, {"http://10.0.1.1:8200"})
    kube.modify("dc-0", terminating=True)  # terminating: out at once, before the DELETE
    seen.expect({"http://10.0.0.7:8100"}, set())
    kube.delete("dc-0")
    kube.delete("pf-0")
    seen.expect(set(), set())


def test_410_gone_relists_and_catches_up_on_missed_changes(cluster) -> None:
    kube, _server, seen, disc = cluster
    kube.add_pod("pf-0", "prefill", ip="10.0.0.1", ready=True)
    seen.expect({"http://10.0.0.1:8100"}, set())
    lists_before = kube.list_calls
    # Changes the live watches never see (history compacted), then 410 on the watches.
    kube.deliver = False
    kube.delete("pf-0")
    kube.add_pod("pf-1", "prefill", ip="10.0.0.2", ready=True)
    kube.add_pod("dc-0", "decode", ip="10.0.1.1", ready=True)
    kube.expire()
    kube.deliver = True
    seen.expect({"http://10.0.0.2:8100"}, {"http://10.0.1.1:8200"})
    assert kube.list_calls >= lists_before + 2  # both roles relisted
    # Every role's watcher relists (mixed too, with no pods): each on its own thread, so wait for the last one.
    wait_until(lambda: all(w.relists >= 2 for w in disc.watchers), 10, "every watcher to relist", interval=0.02)
    # And the watch works again after the relist.
    kube.modify("pf-1", ip="10.0.0.3")
    seen.expect({"http://10.0.0.3:8100"}, {"http://10.0.1.1:8200"})


def test_watch_timeout_resumes_without_relist(cluster) -> None:
    kube, _server, seen, disc = cluster
    kube.add_pod("dc-0", "decode", ip="10.0.1.1", ready=True)
    seen.expect(set(), {"http://10.0.1.1:8200"})
    # The decode watcher, whose version is fresh (it just saw dc-0): a watch of a role that saw no event since
    # an earlier test compacted the history may relist on resuming, which is correct and not what this checks.
    decode = next(w for w in disc.watchers if w.role == "decode")
    relists = decode.relists
    watches = kube.watch_calls

    def decode_watches() -> int:
        return sum("component=decode" in s for s in kube.watched)

    # The server ends each 2 s watch; the client resumes from its last version.
    started = decode_watches()
    wait_until(lambda: decode_watches() > started, 10, "the decode watch to end and resume")
    kube.add_pod("dc-1", "decode", ip="10.0.1.2", ready=True)
    seen.expect(set(), {"http://10.0.1.1:8200", "http://10.0.1.2:8200"})
    assert kube.watch_calls > watches
    assert decode.relists == relists


def test_api_server_restart_reconnects_and_relists(cluster) -> None:
    kube, server, seen, _disc = cluster
    kube.add_pod("pf-0", "prefill", ip="10.0.0.1", ready=True)
    seen.expect({"http://10.0.0.1:8100"}, set())
    server.stop()
    # While the API server is away: a pod goes and another comes (a fresh server has new history).
    kube.deliver = False
    kube.delete("pf-0")
    kube.add_pod("pf-1", "prefill", ip="10.0.0.5", ready=True)
    kube.oldest_rv = kube.rv + 1
    kube.deliver = True
    restarted = ApiServer(kube, port=server.port)
    try:
        seen.expect({"http://10.0.0.5:8100"}, set(), timeout_s=15)
    finally:
        restarted.stop()


def test_pod_url_rules() -> None:
    base = {
        "metadata": {"name": "x"},
        "spec": {"containers": [{"ports": [{"name": "metrics", "containerPort": 9100}]}]},
        "status": {"podIP": "fd00::1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    assert pod_url(base, 8200) == "http://[fd00::1]:8200"
    assert pod_url({**base, "status": {"podIP": "10.1.1.1", "conditions": []}}, 8100) is None
    assert pod_url({**base, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}, 8100) is None
