"""Which prefill workers a decode (or mixed) worker may contact: the ones it was configured with.

The router names the prefill worker of a request in its generate body (``prefill_url``); the decode worker
posts its handshake and the request's page ids there, so a URL taken from a body as is would let whoever
reaches the port make this worker call anything. The name is resolved against ``KVFERRY_PREFILL_PEERS``
instead, and a request naming another worker is refused. An entry's host name stands for every address it
resolves to (a Kubernetes headless Service: its pods' addresses, looked up again every few seconds, so
pods that come and go are known without a restart); an entry without a port stands for every port of its
host (a local cluster whose workers take free ports).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

__all__ = ["PeerDirectory"]

RESOLVE_TTL_S = 5.0  # how long a name's addresses are trusted before they are looked up again


@dataclass(frozen=True)
class _Entry:
    scheme: str
    host: str
    port: int | None  # None: every port of the host


def _parse(url: str) -> _Entry | None:
    try:
        u = urlsplit(url.strip())
        port = u.port
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname or u.username or u.password:
        return None
    if u.path.strip("/") or u.query or u.fragment:
        return None
    return _Entry(u.scheme, u.hostname.lower(), port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass
class PeerDirectory:
    peers: list[str]
    _entries: list[_Entry] = field(init=False)
    _resolved: dict[str, tuple[float, frozenset[str]]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._entries = [e for e in map(_parse, self.peers) if e is not None]

    async def resolve(self, url: str) -> str | None:
        """The base URL of the known prefill worker ``url`` names (rebuilt from its parts: nothing of the
        caller's string beyond scheme, host and port is used), or None when it names none of them."""
        want = _parse(url)
        if want is None or want.port is None:
            return None
        for e in self._entries:
            if e.scheme != want.scheme or (e.port is not None and e.port != want.port):
                continue
            if e.host == want.host or (not _is_ip(e.host) and want.host in await self._addresses(e.host)):
                host = f"[{want.host}]" if ":" in want.host else want.host
                return f"{want.scheme}://{host}:{want.port}"
        return None

    async def _addresses(self, name: str) -> frozenset[str]:
        now = time.monotonic()
        cached = self._resolved.get(name)
        if cached is not None and now - cached[0] < RESOLVE_TTL_S:
            return cached[1]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
            addresses = frozenset(str(info[4][0]).lower() for info in infos)
        except (OSError, UnicodeError):
            addresses = frozenset()  # unresolvable now (a Service not deployed): names nobody
        self._resolved[name] = (now, addresses)
        return addresses
