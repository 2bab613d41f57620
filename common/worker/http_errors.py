"""How a worker's control plane answers bad input and engine refusals: OpenAI-shaped errors, the same as the
router's."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from common.protocol import DecodeError, decode, encode, foreign_version

T = TypeVar("T")


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI-shaped error body; workers and router answer errors the same way."""
    return JSONResponse(error_body(message, type_, code), status_code=status, headers=headers)


def error_body(message: str, type_: str, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def validation_message(errors: Any) -> str:
    """FastAPI's validation errors (of a route's own parameters) as one message."""
    parts = []
    for e in list(errors)[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


class BadMessage(ValueError):
    """A malformed internal protocol message (answered with 400)."""


async def read_message(request: Request, model: type[T]) -> T:
    """Decodes and validates an internal protocol message (version included) from a request body: the pod's edge,
    after which the message travels typed."""
    body = await request.body()
    try:
        return decode(body, model)
    except DecodeError as e:  # not JSON, or not the message: msgspec says what and where (`$.sampling.top_p`)
        raise BadMessage(foreign_version(body) or str(e) or "invalid request") from None


def message_response(msg: Any, status: int = 200) -> Response:
    """A protocol message as a JSON response."""
    return Response(encode(msg), status_code=status, media_type="application/json")


# Engine error codes -> HTTP status, for both workers.
# engine_timeout: the engine may still run the command, so never a refusal status (a prefill peer that answered
# 503 registered nothing; this one may have).
ENGINE_ERROR_STATUS = {
    "unknown_peer": 409,
    "layout_mismatch": 400,
    "invalid_request": 400,
    "queue_full": 429,
    "engine_timeout": 504,
    # The id is live on this worker already: a resent delivery of the same request (router/upstream.py
    # retries under a new id) or a caller's bug; either way not this body's fault, hence not 400.
    "duplicate_request": 409,
    # A prefill worker's request id that a live request to another decode worker holds: nothing registered.
    "request_id_in_use": 409,
    # A prefill for a request its decode worker had already cancelled (prefill_worker/engine.py): refused, nothing registered.
    "cancelled": 410,
}
