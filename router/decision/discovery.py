"""Where the workers are: static URL lists, or Kubernetes pods found by label.

A discovery source calls ``on_change(role, urls)`` with the full current URL set of a role whenever it
changes; the pool (router/decision/pool.py) does the rest (health, pod ids, load). ``on_change`` may be called
from another thread: the app wraps it with ``loop.call_soon_threadsafe``.

Kubernetes: one thread per role lists pods by label selector
(``app.kubernetes.io/name=kvferry,app.kubernetes.io/component=<role>``) in the namespace, then watches
from the list's resourceVersion with the ``kubernetes`` client. Only pods that can take traffic count:
Ready condition True, a pod IP, not terminating. The URL is ``http://<podIP>:<port>`` with the container
port named ``http``, else the role's default port (8100 prefill, 8200 decode). A watch that ends
normally (server timeout) is resumed from the last resourceVersion seen; "410 Gone" (the version was
compacted away) means relist; any other failure (API server restart, network) backs off and relists.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("kvferry.router")

__all__ = [
    "Discovery",
    "KubernetesDiscovery",
    "PodWatcher",
    "StaticDiscovery",
    "default_namespace",
    "pod_url",
    "role_selector",
]

OnChange = Callable[[str, set[str]], None]
ROLE_PORTS = {"prefill": 8100, "decode": 8200, "mixed": 8300}
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class Discovery(Protocol):
    def start(self, on_change: OnChange) -> None: ...

    def stop(self) -> None: ...


class StaticDiscovery:
    """Fixed URL lists (flags or ``KVFERRY_PREFILL_URLS`` / ``KVFERRY_DECODE_URLS`` / ``KVFERRY_MIXED_URLS``)."""

    def __init__(self, prefill_urls: Iterable[str], decode_urls: Iterable[str], mixed_urls: Iterable[str] = ()) -> None:
        self.urls = {
            "prefill": {u.rstrip("/") for u in prefill_urls if u},
            "decode": {u.rstrip("/") for u in decode_urls if u},
            "mixed": {u.rstrip("/") for u in mixed_urls if u},
        }

    def start(self, on_change: OnChange) -> None:
        for role, urls in self.urls.items():
            on_change(role, set(urls))

    def stop(self) -> None:
        pass


def role_selector(role: str) -> str:
    return f"app.kubernetes.io/name=kvferry,app.kubernetes.io/component={role}"


def default_namespace(configured: str = "") -> str:
    if configured:
        return configured
    try:
        return _SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def pod_url(pod: dict[str, Any], default_port: int) -> str | None:
    """The pod's worker URL if it can take traffic now, else None. ``pod`` is the API's JSON object."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp"):  # terminating: draining, or about to disappear
        return None
    ip = status.get("podIP")
    if not ip:
        return None
    conditions = status.get("conditions") or []
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        return None
    port = default_port
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == "http" and p.get("containerPort"):
                port = int(p["containerPort"])
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


class PodWatcher:
    """List-then-watch of one role's pods, on its own thread."""

    def __init__(
        self,
        api: Any,  # kubernetes.client.CoreV1Api
        namespace: str,
        role: str,
        on_change: OnChange,
        *,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 10.0,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.role = role
        self.selector = role_selector(role)
        self.default_port = ROLE_PORTS[role]
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_backoff_s = max_backoff_s
        self.pods: dict[str, str | None] = {}  # pod name -> URL (None: not ready)
        self.relists = 0
        self._published: set[str] | None = None
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread: threading.Thread | None = None

    # ---- thread ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"k8s-watch-{self.role}", daemon=True)
        self._thread.start()

    def stop(self, join_s: float = 2.0) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.stop()
        if self._thread is not None:
            self._thread.join(join_s)

    def run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        backoff = 0.0
        while not self._stop.is_set():
            try:
                rv = self._relist()
                backoff = 0.0
                while not self._stop.is_set():
                    rv = self._watch_from(rv)
            except ApiException as exc:
                if exc.status == 410:
                    log.info("pod watch expired (410); relisting", extra={"role": self.role})
                    continue
                backoff = self._backoff(backoff, f"API error {exc.status}: {exc.reason}")
            except Exception as exc:  # connection refused/reset, timeouts, bad JSON: retry from a fresh list
                if self._stop.is_set():
                    return
                backoff = self._backoff(backoff, f"{type(exc).__name__}: {exc}")

    def _backoff(self, current: float, reason: str) -> float:
        delay = min(self.max_backoff_s, max(0.2, current * 2))
        log.warning("pod discovery failed; retrying", extra={"role": self.role, "reason": reason, "in_s": delay})
        self._stop.wait(delay)
        return delay

    # ---- list and watch ----------------------------------------------------------------------------
    def _relist(self) -> str:
        resp = self.api.list_namespaced_pod(
            self.namespace,
            label_selector=self.selector,
            _preload_content=False,
            _request_timeout=self.request_timeout_s,
        )
        try:
            data = json.loads(resp.data)
        finally:
            resp.release_conn()
        self.relists += 1
        self.pods = {
            (item.get("metadata") or {}).get("name", ""): pod_url(item, self.default_port)
            for item in data.get("items") or []
        }
        self._publish()
        return str((data.get("metadata") or {}).get("resourceVersion") or "")

    def _watch_from(self, rv: str) -> str:
        """Watches until the server ends the watch; returns the last resourceVersion seen. Raises
        ApiException(410) when ``rv`` is too old."""
        from kubernetes import watch

        w = watch.Watch()
        self._watch = w
        kwargs: dict[str, Any] = {
            "label_selector": self.selector,
            # timeout_seconds also turns off the client's own silent retry after a 410, which would
            # resume from a version it picked; we want to relist instead.
            "timeout_seconds": self.watch_timeout_s,
            "allow_watch_bookmarks": True,
            "_request_timeout": (self.request_timeout_s, self.watch_timeout_s + 30),
        }
        if rv:
            kwargs["resource_version"] = rv
        try:
            for event in w.stream(self.api.list_namespaced_pod, self.namespace, **kwargs):
                obj = event.get("raw_object") or {}
                meta = obj.get("metadata") or {}
                rv = str(meta.get("resourceVersion") or rv)
                kind = event.get("type")
                name = meta.get("name")
                if kind == "BOOKMARK" or not name:
                    continue
                if kind == "DELETED":
                    self.pods.pop(name, None)
                else:  # ADDED / MODIFIED (ready flips, IP assigned or changed)
                    self.pods[name] = pod_url(obj, self.default_port)
                self._publish()
                if self._stop.is_set():
                    break
        finally:
            self._watch = None
        return rv

    def _publish(self) -> None:
        urls = {u for u in self.pods.values() if u}
        if urls != self._published:
            self._published = urls
            log.info("pods changed", extra={"role": self.role, "ready": len(urls)})
            self.on_change(self.role, set(urls))


class KubernetesDiscovery:
    """Prefill, decode and mixed pods of this namespace, by label, through the Kubernetes API."""

    def __init__(self, namespace: str = "", api_client: Any = None, **watcher_kwargs: Any) -> None:
        self.namespace = default_namespace(namespace)
        self.api_client = api_client
        self.watcher_kwargs = watcher_kwargs
        self.watchers: list[PodWatcher] = []

    def start(self, on_change: OnChange) -> None:
        from kubernetes import client, config

        api_client = self.api_client
        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        api = client.CoreV1Api(api_client)
        for role in ROLE_PORTS:
            w = PodWatcher(api, self.namespace, role, on_change, **self.watcher_kwargs)
            self.watchers.append(w)
            w.start()

    def stop(self) -> None:
        for w in self.watchers:
            w.stop()
