"""Every worker role is the one worker process with its role's plug-ins (common/worker/roles.py): the routes a
role has are its plug-ins' plus the ones every role answers, and those answer the same way on every role. Real
apps, no engine started (no lifespan), so the answers are the control plane's own."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from common.worker.control import create_app
from common.worker.roles import ROLE_TABLE, plugins

SAMPLING = {"max_tokens": 4}
GENERATE = {"req_id": "g1", "token_ids": [1, 2, 3], "sampling": SAMPLING}
PREFILL = {**GENERATE, "dst_agent": "a", "dst_instance_id": "i", "dst_pages": [0]}
# route -> the roles that have it
ROLE_ROUTES = {
    "/internal/generate": {"decode", "mixed"},
    "/internal/prefill": {"prefill", "mixed"},
    "/internal/handshake": {"prefill", "mixed"},
    "/internal/cancel": {"prefill", "mixed"},
    "/internal/stats": {"prefill", "mixed"},
    "/internal/abort": {"prefill", "decode", "mixed"},
    "/metrics": {"prefill", "decode", "mixed"},
}


def paths(role: str) -> set[str]:
    return {getattr(r, "path", "") for r in create_app(role).routes}


@pytest.mark.parametrize("role", list(ROLE_TABLE))
def test_a_role_has_its_plug_ins_routes_and_the_common_ones(role: str) -> None:
    have = paths(role)
    for route, roles in ROLE_ROUTES.items():
        assert (route in have) == (role in roles), (role, route)


def test_mixed_is_the_prefill_and_decode_plug_ins_over_one_engine() -> None:
    assert plugins("mixed") == plugins("prefill") + plugins("decode")  # prefill first: it aborts what it holds
    with pytest.raises(ValueError, match="unknown worker role"):
        plugins("router")


@pytest.mark.parametrize("role", list(ROLE_TABLE))
def test_probes_and_abort_answer_the_same_on_every_role(role: str) -> None:
    client = TestClient(create_app(role))
    assert client.get("/health").json() == {"status": "ok"}
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
    load = client.get("/load").json()
    assert load["role"] == role and load["ready"] is False and load["live_requests"] == 0
    for req_id in ("never-here", "g1"):
        assert client.post("/internal/abort", json={"req_id": req_id}).status_code == 204
    bad = client.post("/internal/abort", json={"id": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("role", list(ROLE_TABLE))
def test_a_worker_not_ready_refuses_work_the_same_way_on_every_route(role: str) -> None:
    client = TestClient(create_app(role))
    bodies = {"/internal/generate": GENERATE, "/internal/prefill": PREFILL}
    for route, body in bodies.items():
        if role not in ROLE_ROUTES[route]:
            assert client.post(route, json=body).status_code == 404
            continue
        r = client.post(route, json=body)
        assert r.status_code == 503, r.text
        assert r.json()["error"] == {
            "message": f"{role} worker not ready",
            "type": "unavailable",
            "param": None,
            "code": "not_ready",
        }
