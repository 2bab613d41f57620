"""How a kvferry deployment reaches its Redis: credentials, TLS and the key prefix it writes under.

- ``KVFERRY_REDIS_URL``: ``redis://`` or ``rediss://`` (TLS); it may carry ``user:password@`` itself;
- ``KVFERRY_REDIS_PASSWORD`` (and ``KVFERRY_REDIS_USERNAME`` for an ACL user): the credentials kept out of
  the URL, e.g. from a Kubernetes Secret (a password in the URL wins over this one);
- ``KVFERRY_REDIS_TLS_CA``: the CA file that verifies a ``rediss://`` server (default: the system's);
  ``KVFERRY_REDIS_TLS_CERT`` / ``KVFERRY_REDIS_TLS_KEY``: a client certificate for a server that asks for one;
- ``KVFERRY_REDIS_PREFIX`` (``kvf``): the first part of every key, so two deployments can share one Redis.

Plain settings, no redis import: common/config.py carries them to the router and to the engine process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_KEY_PREFIX", "RedisAccess"]

DEFAULT_KEY_PREFIX = "kvf"


@dataclass(frozen=True)
class RedisAccess:
    password: str | None = None
    username: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    key_prefix: str = DEFAULT_KEY_PREFIX

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RedisAccess:
        env = os.environ if environ is None else environ
        prefix = env.get("KVFERRY_REDIS_PREFIX", "").strip() or DEFAULT_KEY_PREFIX
        if any(c.isspace() for c in prefix):
            raise ValueError(f"KVFERRY_REDIS_PREFIX must not contain spaces: {prefix!r}")
        return cls(
            password=env.get("KVFERRY_REDIS_PASSWORD") or None,
            username=env.get("KVFERRY_REDIS_USERNAME") or None,
            tls_ca=env.get("KVFERRY_REDIS_TLS_CA") or None,
            tls_cert=env.get("KVFERRY_REDIS_TLS_CERT") or None,
            tls_key=env.get("KVFERRY_REDIS_TLS_KEY") or None,
            key_prefix=prefix,
        )

    def client_kwargs(self, url: str) -> dict[str, Any]:
        """Keyword arguments for redis-py's ``from_url(url, ...)`` (credentials in the URL take precedence:
        redis-py applies the URL's over these)."""
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
