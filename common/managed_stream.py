"""A streamed HTTP response whose clean-up always runs, however the request ends.

A ``StreamingResponse`` body is an async generator: when the peer hangs up before the server started
iterating it (the disconnect is seen first, the streaming task is cancelled before its first step), the
generator never runs, so its ``finally`` never runs either, and whatever the request holds (a router's
upstream calls, a worker's engine request and its pages) would be held for nobody. ``ManagedStream`` runs
``on_close`` when the response ends, every way it can: streamed to the end, the peer gone at any moment
(Starlette cancels the stream when it sees the disconnect), or the body failing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["ManagedStream"]


class ManagedStream(StreamingResponse):
    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        media_type: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()
