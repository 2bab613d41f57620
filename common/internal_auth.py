"""The shared secret on the workers' internal API (``/internal/*``: generate, prefill, handshake, abort,
agent, stats): without it anyone who reaches a worker's port could start requests or register a NIXL peer.

``KVFERRY_INTERNAL_TOKEN`` (in Kubernetes from a Secret) holds one token, or several separated by commas:
callers (the router, a decode worker asking a prefill peer) send the first as ``Authorization: Bearer
<token>``; workers accept any of them. That is how the token rotates without a failed call: add the new one
second, restart everything, put it first, restart, drop the old one. Unset: the internal API is open (a
local `kvferry up`, tests). ``/health``, ``/ready``, ``/load`` and ``/metrics`` stay open for
probes and scrapers.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from common.settings_registry import INTERNAL_TOKEN

__all__ = ["INTERNAL_PREFIX", "TOKEN_ENV", "InternalToken"]

TOKEN_ENV = INTERNAL_TOKEN.name
INTERNAL_PREFIX = "/internal/"


@dataclass(frozen=True)
class InternalToken:
    tokens: tuple[str, ...] = ()

    @classmethod
    def parse(cls, value: str) -> InternalToken:
        return cls(INTERNAL_TOKEN.parse(value))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> InternalToken:
        return cls(INTERNAL_TOKEN.read(environ))

    @property
    def required(self) -> bool:
        return bool(self.tokens)

    def headers(self) -> dict[str, str]:
        """What a caller sends (nothing when no token is set)."""
        return {"authorization": f"Bearer {self.tokens[0]}"} if self.tokens else {}

    def accepts(self, authorization: bytes | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the tokens (always, when none is set);
        compared in constant time, every token tried (the time says nothing about which one nearly matched)."""
        if not self.tokens:
            return True
        scheme, _, given = (authorization or b"").strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        given = given.strip()
        matched = False
        for token in self.tokens:
            matched |= hmac.compare_digest(given, token.encode())
        return matched

    def __repr__(self) -> str:  # settings reach logs and tracebacks: never the secret
        return f"InternalToken({len(self.tokens)} token(s))"
