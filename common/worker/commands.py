"""What an engine role plugs into its worker's engine (``EngineRole``: its commands and the asks the loop makes of
it) and how the engine runs one command and answers it (``run_command``).

Every call is answered in the loop turn that handles it: a handler queues what takes longer and reports it by
events, so a caller never waits on admission.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from common.sched.scheduler import DuplicateRequest, RequestRejected
from common.worker.messages import Call, Reply, Wire

log = logging.getLogger("kvferry.engine")

# command type -> what runs it (returns the reply's result)
Handlers = dict[type, Callable[[Any], Wire | None]]


class Refused(Exception):
    """A command the engine will not run; the caller's ``EngineError`` carries ``code``."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class EngineRole(Protocol):
    """One job of an engine over its host's scheduler, pool and agent; built as ``role_cls(host)``, before the
    scheduler (which it may use only once built). Each role is also a `KVConnector` subclass: what the scheduler
    asks about its requests' KV transfer (common/sched/kv_connector.py)."""

    handlers: Handlers  # this role's commands (disjoint from every other role's)

    def has_work(self) -> bool: ...

    def holds(self, req_id: str) -> bool:
        """Whether this role is the one to abort the request (the first role holding it does)."""
        ...

    def abort(self, req_id: str, reason: str, error: str | None) -> None: ...

    def waits_only(self) -> bool:
        """Whether all of this role's work waits on something no sooner loop turn brings (staging space)."""
        ...

    def hands_on_stamps(self, req_id: str) -> bool:
        """Whether this request's stage stamps leave with its KV (a prefill for a peer: in the KV notice and
        the done event) rather than with its first-token event, which drops them when the request finishes."""
        ...

    def tick(self) -> None:
        """Advances transfers and deadlines; called every loop turn."""
        ...


def run_command(handlers: Handlers, msg: Wire, role: str) -> Reply | None:
    """Runs a command; a ``Call``'s outcome is its ``Reply``, a cast's is not reported (None)."""
    rpc, cmd = (msg.rpc, msg.cmd) if isinstance(msg, Call) else (None, msg)
    error: tuple[str, str] | None = None
    result = None
    try:
        handler = handlers.get(type(cmd))
        if handler is None:
            raise Refused(f"{type(cmd).__name__} is no command of a {role} engine", "invalid_request")
        result = handler(cmd)
    except Refused as e:
        error = str(e), e.code
    except DuplicateRequest as e:
        error = str(e), "duplicate_request"
    except RequestRejected as e:
        error = str(e), "invalid_request"
    except Exception as e:  # a bad command must not take the engine down
        log.exception("engine command failed", extra={"op": type(cmd).__name__})
        error = f"{type(e).__name__}: {e}", "engine_error"
    if rpc is None:
        return None
    return Reply(rpc, result) if error is None else Reply(rpc, error=error[0], code=error[1])
