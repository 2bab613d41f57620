"""The prefill role's plug-in (common/worker/roles.py): prompts prefilled for a decode peer's reserved pages,
each chunk sent over NIXL (engine.py), and the routes peers call (routes.py)."""

from __future__ import annotations

from common.worker.roles import RolePlugin
from prefill_worker.routes import add_prefill_routes

PLUGIN = RolePlugin(engine="prefill_worker.engine:PrefillRole", add_routes=add_prefill_routes)
