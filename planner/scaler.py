"""Where the planner's decisions go: the Deployments' scale subresource (the kubernetes client, with RBAC for
get and patch on deployments/scale of the worker Deployments only), or nowhere (dry run: logged and exported
as metrics only). Scaling a Deployment down removes pods the usual way: each gets SIGTERM and drains what it
runs (KVFERRY_DRAIN_SECONDS) before it exits, so no request is lost."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from planner.sizing import Counts

__all__ = ["DeploymentScaler", "DryRun", "Scaler"]

log = logging.getLogger("kvferry.planner")
ROLES = ("prefill", "decode", "mixed")


class Scaler(Protocol):
    def apply(self, targets: Counts) -> dict[str, int]:
        """Asks for `targets`; returns the replicas each role was set to (nothing in a dry run)."""
        ...


@dataclass
class DryRun:
    def apply(self, targets: Counts) -> dict[str, int]:
        log.info("dry run: would scale", extra={"targets": targets.__dict__})
        return {}


@dataclass
class DeploymentScaler:
    """Patches ``spec.replicas`` through ``deployments/{name}/scale`` for each role that has a Deployment."""

    api: Any  # kubernetes.client.AppsV1Api
    namespace: str
    deployments: dict[str, str]  # role -> Deployment name
    last: dict[str, int] = field(default_factory=dict)

    def current(self) -> dict[str, int]:
        return {
            role: int(self.api.read_namespaced_deployment_scale(name, self.namespace).spec.replicas or 0)
            for role, name in self.deployments.items()
        }

    def apply(self, targets: Counts) -> dict[str, int]:
        done: dict[str, int] = {}
        for role, name in self.deployments.items():
            want = getattr(targets, role)
            if self.last.get(role) == want:
                continue
            self.api.patch_namespaced_deployment_scale(name, self.namespace, {"spec": {"replicas": want}})
            self.last[role] = want
            done[role] = want
            log.info("scaled", extra={"deployment": name, "replicas": want})
        return done
