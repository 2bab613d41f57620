"""What a decode worker's non-200 answer to `POST /internal/generate` means for the call: raised as is (the
client's fault) or a `Retry` on other workers, with which worker to blame. One row per known answer."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from router.errors import OpenAIError, bad_request, no_worker, rate_limited, upstream_failed


class Retry(Exception):
    """A failure before the first token: try other pods."""

    def __init__(
        self, error: OpenAIError, blame_decode: bool, blame_prefill: bool, local: bool = False, moved: bool = False
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.blame_decode = blame_decode
        self.blame_prefill = blame_prefill
        self.local = local  # retry with the prompt prefilled on the decode worker (no prefill worker)
        self.moved = moved  # not a failure: given back to be placed again (a prefill worker is up again)


@dataclass(frozen=True)
class WorkerAnswer:
    status: int
    code: str | None
    message: str
    retry_after_s: int  # the answer's Retry-After, else the router's default
    has_prefill: bool  # the call used a prefill worker


def error_message(status: int, raw: bytes) -> tuple[str, str | None]:
    """The message and code of an OpenAI-style (or FastAPI `detail`) error body; a generic message otherwise."""
    message, code = f"decode worker answered {status}", None
    try:
        body = json.loads(raw)
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            code = err.get("code") if isinstance(err.get("code"), str) else None
        elif isinstance(body, dict) and isinstance(body.get("detail"), str):
            message = body["detail"]
    except (ValueError, TypeError):
        pass
    return message, code


# (status, code or None for any) -> what to raise. Order matters: the first row that matches wins.
_ROWS: list[tuple[int, str | None, Callable[[WorkerAnswer], Exception]]] = [
    # The engine did not answer its control call in time: overload, so 429 if no other worker takes it.
    (
        504,
        "engine_timeout",
        lambda a: Retry(rate_limited(f"the decode worker is overloaded: {a.message}", a.retry_after_s), True, False),
    ),
    # A resent POST whose first copy arrived: that copy is aborted when its response closes; retry under a new id.
    (409, "duplicate_request", lambda a: Retry(upstream_failed(f"duplicate delivery: {a.message}"), False, False)),
    # The decode worker lacks this prefill peer (KVFERRY_PREFILL_PEERS): its own prefill serves, the log says why.
    (403, "unknown_prefill_peer", lambda a: Retry(upstream_failed(a.message), False, True, local=True)),
    *((status, None, lambda a: bad_request(a.message, None, a.code)) for status in (400, 413, 422)),
    (
        429,
        None,
        lambda a: Retry(rate_limited(f"all decode workers are busy: {a.message}", a.retry_after_s), True, False),
    ),
    # Not ready or draining (marked so until the poller says it is back).
    (503, None, lambda a: Retry(no_worker("decode"), True, False)),
]


def failure_for(answer: WorkerAnswer) -> Exception:
    for status, code, make in _ROWS:
        if answer.status == status and (code is None or answer.code == code):
            return make(answer)
    return Retry(upstream_failed(answer.message), True, answer.status >= 500 and answer.has_prefill)


def retry_after_seconds(value: str | None, default: int) -> int:
    try:
        return max(1, int(float(value))) if value else default
    except ValueError:
        return default
