"""How a kvferry deployment reaches its Redis (``KVFERRY_REDIS_*``: URL, credentials kept out of it, TLS files,
the key prefix two deployments sharing a Redis tell apart by). Plain settings, no redis import: common/config.py
carries them to the router and the engine process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common import settings_registry as reg

__all__ = ["DEFAULT_KEY_PREFIX", "RedisAccess"]

DEFAULT_KEY_PREFIX = reg.REDIS_PREFIX.default


@dataclass(frozen=True)
class RedisAccess(reg.EnvFields):
    password: str | None = reg.REDIS_PASSWORD.field()
    username: str | None = reg.REDIS_USERNAME.field()
    tls_ca: str | None = reg.REDIS_TLS_CA.field()
    tls_cert: str | None = reg.REDIS_TLS_CERT.field()
    tls_key: str | None = reg.REDIS_TLS_KEY.field()
    key_prefix: str = reg.REDIS_PREFIX.field()

    def client_kwargs(self, url: str) -> dict[str, Any]:
        """Keyword arguments for redis-py's ``from_url(url, ...)`` (credentials in the URL win)."""
        kw: dict[str, Any] = {}
        if self.password:
            kw["password"] = self.password
        if self.username:
            kw["username"] = self.username
        if url.startswith("rediss://"):
            kw["ssl_cert_reqs"] = "required"
            if self.tls_ca:
                kw["ssl_ca_certs"] = self.tls_ca
            if self.tls_cert:
                kw["ssl_certfile"] = self.tls_cert
            if self.tls_key:
                kw["ssl_keyfile"] = self.tls_key
        return kw

    def __repr__(self) -> str:  # never print the password (settings end up in logs and tracebacks)
        shown = "***" if self.password else None
        return f"RedisAccess(password={shown}, username={self.username!r}, tls_ca={self.tls_ca!r}, key_prefix={self.key_prefix!r})"
