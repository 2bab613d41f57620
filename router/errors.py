"""Errors in OpenAI's JSON shape, and the handlers that make every failure path answer in it.

OpenAI clients parse ``{"error": {"message", "type", "param", "code"}}`` and pick their exception class
from the HTTP status, so the status matters as much as the body: bad input is always a 4xx (FastAPI's
default 422 for validation errors is replaced by 400), and only our own faults are 5xx.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.http_guard import error_body

log = logging.getLogger("kvferry.router")

__all__ = [
    "OpenAIError",
    "bad_request",
    "context_too_long",
    "error_body",
    "error_response",
    "install_error_handlers",
    "model_not_found",
    "no_worker",
    "operator_only",
    "prompt_too_long",
    "rate_limited",
    "unauthorized",
    "upstream_failed",
]


class OpenAIError(Exception):
    """An error to send to the client as-is (status, OpenAI error body, extra headers)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def context_too_long(context: int, prompt: int, completion: int, param: str) -> OpenAIError:
    return OpenAIError(
        400,
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the {param}, {completion} in the completion). "
        f"Please reduce the length of the {param} or completion.",
        "invalid_request_error",
        param,
        "context_length_exceeded",
    )


def prompt_too_long(context: int, at_least: int, param: str) -> OpenAIError:
    """``context_too_long`` for a prompt refused before it was tokenized whole: its count is a lower bound."""
    return OpenAIError(
        400,
        f"This model's maximum context length is {context} tokens. However, there are at least {at_least} "
        f"tokens in the {param}. Please reduce the length of the {param}.",
        "invalid_request_error",
        param,
        "context_length_exceeded",
    )


def unauthorized() -> OpenAIError:
    return OpenAIError(
        401,
        "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
        "invalid_request_error",
        None,
        "invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def operator_only() -> OpenAIError:
    return OpenAIError(
        403,
        "This operator route shows other clients' requests and the workers' addresses: with no API key set it "
        "answers only on the router's own host (loopback). Set KVFERRY_API_KEY to reach it with the key.",
        "invalid_request_error",
        None,
        "operator_only",
    )


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model '{model}' does not exist or you do not have access to it.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def rate_limited(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(
        429, message, "rate_limit_error", None, "rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)}
    )


# What a 503 for "no worker ready" tells a client to wait: a worker whose engine died is back in a few seconds
# (docs/reliability.md), and the pool sees it within a poll; clients that honour Retry-After (the openai
# library does) come back then instead of at once.
NO_WORKER_RETRY_AFTER_S = 1


def no_worker(role: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"No {role} worker is ready; try again shortly.",
        "server_error",
        None,
        "service_unavailable",
        headers={"Retry-After": str(NO_WORKER_RETRY_AFTER_S)},
    )


def upstream_failed(message: str) -> OpenAIError:
    return OpenAIError(502, message, "server_error", None, "upstream_error")


# Names pydantic puts in an error's loc for the branch of a union that failed ("str", "list[int]", ...):
# not parameters. Exact names, so that real fields such as "stream" or "integer_thing" are kept.
_UNION_BRANCHES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
_UNION_PREFIXES = ("function-", "list[", "dict[", "literal[", "tuple[")


def _validation_message(exc: RequestValidationError, content_type: str) -> tuple[str, str | None]:
    """First validation error as ``param: message`` (OpenAI reports one problem at a time)."""
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    err = errors[0]
    # loc is ("body", field, ...) for body errors; drop "body" and pydantic's union-branch names.
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request.", None
    if not loc and err.get("type") == "missing":
        return "The request body is empty: send a JSON object.", None
    if not loc and "json" not in content_type.lower():
        # FastAPI parses JSON only when the request says it is JSON (curl -d sends a form's type by default).
        got = f"'{content_type}'" if content_type else "none"
        return f"Send the body as JSON with 'Content-Type: application/json' (the Content-Type was {got}).", None
    param = ".".join(p for p in loc if p not in _UNION_BRANCHES and not p.startswith(_UNION_PREFIXES)) or None
    msg = str(err.get("msg", "invalid value"))
    # pydantic prefixes custom ValueErrors with "Value error, "; the client does not need to see that.
    msg = msg.removeprefix("Value error, ")
    if err.get("type") == "missing":
        msg = "field required"
    return (f"{param}: {msg}" if param else msg), param


_DOCUMENTED_ERRORS = {
    "400": "Invalid request: OpenAI error object (`error.message`, `error.type`, `error.param`, `error.code`)",
    "401": "Missing or wrong API key (when the router requires one)",
    "404": "Unknown model",
    "413": "Request body too large",
    "414": "Request URL too long",
    "431": "Request headers too large or too many",
    "429": "Queue full; retry after the `Retry-After` seconds",
    "503": "No worker available",
}


def _openapi_with_our_errors(app: FastAPI):  # type: ignore[no-untyped-def]
    """FastAPI advertises 422 for validation errors; this router answers them with 400 (OpenAI's status)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, ops in schema.get("paths", {}).items():
                for op in ops.values():
                    responses = op.get("responses", {})
                    responses.pop("422", None)
                    if path.startswith("/v1/"):
                        for status, text in _DOCUMENTED_ERRORS.items():
                            responses.setdefault(status, {"description": text})
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def install_error_handlers(app: FastAPI) -> None:
    app.openapi = _openapi_with_our_errors(app)  # type: ignore[method-assign]

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc, request.headers.get("content-type", ""))
        return error_response(bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        return JSONResponse(
            error_body(detail, type_, None, code), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in the router")
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", "server_error", None, "internal_error"), status_code=500
        )
