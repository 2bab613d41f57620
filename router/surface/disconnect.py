"""Work that stops when the client hangs up."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

__all__ = ["ClientGone", "unless_disconnected"]

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the work was done."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs ``work`` but gives up (cancelling it) if the client disconnects first: a client that hangs up
    must not keep workers generating. What the work started is the caller's to close either way (the work
    may even finish despite the cancel: its result is then dropped), so callers register what they start
    before awaiting it (router/surface/service.py ``Job.choices``)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
