"""The decode role's plug-in (common/worker/roles.py): requests prefilled here or by a peer into pages reserved
here, then decoded (engine.py), and the generate stream the router reads (routes.py)."""

from __future__ import annotations

from common.worker.roles import RolePlugin
from decode_worker.routes import add_decode_routes

PLUGIN = RolePlugin(engine="decode_worker.engine:DecodeRole", add_routes=add_decode_routes)
