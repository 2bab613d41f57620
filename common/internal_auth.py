"""The shared secret on the workers' internal API (``/internal/*``): without it anyone reaching a worker's port
could start requests or register a NIXL peer. ``KVFERRY_INTERNAL_TOKEN`` holds one token or several (commas):
the first is sent, any is accepted, which is how it rotates (docs/kubernetes.md). Unset: the API is open.
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
        return {"authorization": f"Bearer {self.tokens[0]}"} if self.tokens else {}

    def accepts(self, authorization: bytes | None) -> bool:
        """Whether an ``Authorization`` value carries one of the tokens (always, when none is set), compared in
        constant time against every token."""
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
