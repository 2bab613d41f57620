"""The prefix index behind closed doors, against real redis-server processes: a Redis started with
``--requirepass`` (workers and routers authenticate; without the password they get nothing in and read
nothing out), one serving only TLS with certificates made here (``rediss://``, the CA checked, a client
certificate sent), and two deployments sharing one Redis under their own key prefixes."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from common.devcluster.process import ManagedProcess
from common.net import free_port
from common.prefix.access import RedisAccess
from common.prefix.hashing import chained_block_hashes
from common.prefix.publisher import PrefixIndexPublisher
from common.prefix.reader import PrefixIndexReader

MODEL = "m-access"
PASSWORD = "pw-" + uuid.uuid4().hex
HASHES = chained_block_hashes(list(range(64)), 16)


def _redis_server(tmp: Path, *args: str) -> ManagedProcess:
    part = ManagedProcess(
        "redis", ["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *args], {}, tmp / "r.log"
    )
    part.start()
    return part


def _wait(client: redis.Redis, part: ManagedProcess) -> None:
    deadline = time.monotonic() + 10
    while True:
        assert part.alive(), part.log_tail()
        try:
            if client.ping():
                return
        except redis.RedisError:
            pass
        assert time.monotonic() < deadline, part.log_tail()
        time.sleep(0.05)


def _published(url: str, access: RedisAccess, pod: str = "pod-a") -> PrefixIndexPublisher:
    pub = PrefixIndexPublisher(url, MODEL, pod, flush_interval_s=0.01, access=access, socket_timeout_s=0.5)
    pub.start()
    pub.stored(HASHES)
    return pub


UNANSWERED_LIMIT_S = 10.0


def _match(url: str, access: RedisAccess, pods: list[str], deadline_s: float = 5.0) -> dict[str, int] | None:
    """What a router reading through ``access`` sees; waits (bounded) for a publisher's flush."""

    async def run() -> dict[str, int] | None:
        reader = PrefixIndexReader(url, MODEL, socket_timeout_s=0.5, access=access, max_backoff_s=0.1)
        try:
            start = time.monotonic()
            while True:
                got = await reader.match(HASHES, pods)
                waited = time.monotonic() - start
                # None is "Redis did not answer" (a slow first connect on a busy box), not "no blocks": it is
                # asked again for longer, so that only a real answer decides what a router sees.
                if got is not None and (any(got.values()) or waited > deadline_s):
                    return got
                if waited > max(deadline_s, UNANSWERED_LIMIT_S):
                    return got
                await asyncio.sleep(0.05)
        finally:
            await reader.aclose()

    return asyncio.run(run())


# ---- AUTH ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    part = _redis_server(tmp_path_factory.mktemp("auth"), "--port", str(port), "--requirepass", PASSWORD)
    try:
        _wait(redis.Redis(port=port, password=PASSWORD), part)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        part.stop()


def test_password_from_the_setting_lets_workers_and_routers_in(auth_redis: str) -> None:
    access = RedisAccess.from_env({"KVFERRY_REDIS_PASSWORD": PASSWORD})
    pub = _published(auth_redis, access)
    try:
        assert _match(auth_redis, access, ["pod-a"]) == {"pod-a": len(HASHES)}
    finally:
        pub.stop()


def test_password_in_the_url_works_too(auth_redis: str) -> None:
    url = auth_redis.replace("redis://", f"redis://:{PASSWORD}@")
    pub = _published(url, RedisAccess(), pod="pod-url")
    try:
        assert _match(url, RedisAccess(), ["pod-url"]) == {"pod-url": len(HASHES)}
    finally:
        pub.stop()


def test_without_the_password_nothing_gets_in_or_out(auth_redis: str) -> None:
    """A publisher without credentials writes nothing (Redis answers NOAUTH), and a reader without them gets
    no answer (routing falls back to load), whatever an authenticated pod published."""
    good = RedisAccess(password=PASSWORD)
    writer = _published(auth_redis, good, pod="pod-real")
    stranger = _published(auth_redis, RedisAccess(), pod="pod-stranger")
    wrong = _published(auth_redis, RedisAccess(password="guess"), pod="pod-guess")
    try:
        assert _match(auth_redis, good, ["pod-real"]) == {"pod-real": len(HASHES)}
        assert _match(auth_redis, RedisAccess(), ["pod-real"], deadline_s=0.5) is None
        assert _match(auth_redis, RedisAccess(password="guess"), ["pod-real"], deadline_s=0.5) is None
        keys = redis.Redis.from_url(auth_redis, password=PASSWORD).keys("*")
        assert keys and not [k for k in keys if b"pod-stranger" in k or b"pod-guess" in k], keys
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(auth_redis).set("x", "y")
    finally:
        for p in (writer, stranger, wrong):
            p.stop()


def test_two_deployments_share_one_redis_under_their_own_prefixes(auth_redis: str) -> None:
    """Same model, same pod names, one Redis: each deployment's router sees only its own pods' blocks."""
    blue = RedisAccess(password=PASSWORD, key_prefix="blue")
    green = RedisAccess(password=PASSWORD, key_prefix="green")
    pub = _published(auth_redis, blue, pod="pod-shared")
    try:
        assert _match(auth_redis, blue, ["pod-shared"]) == {"pod-shared": len(HASHES)}
        assert _match(auth_redis, green, ["pod-shared"], deadline_s=0.5) == {"pod-shared": 0}
        keys = redis.Redis.from_url(auth_redis, password=PASSWORD).keys("*pod-shared*")
        assert keys and all(k.startswith(b"blue:") for k in keys), keys
    finally:
        pub.stop()
    with pytest.raises(ValueError):
        RedisAccess.from_env({"KVFERRY_REDIS_PREFIX": "two words"})


def test_the_password_is_never_printed() -> None:
    access = RedisAccess.from_env({"KVFERRY_REDIS_PASSWORD": PASSWORD})
    assert PASSWORD not in repr(access) and PASSWORD not in str(access)


# ---- TLS -----------------------------------------------------------------------------------------
def _cert(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    else:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.with_suffix(".key").write_bytes(key_pem)
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory) -> Iterator[tuple[str, dict[str, str]]]:
    """redis-server on a TLS port only (no plain port), requiring a password and a client certificate signed
    by the CA made here; yields its rediss:// URL and the KVFERRY_REDIS_* settings that reach it."""
    tmp = tmp_path_factory.mktemp("tls")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("kvferry test CA", ca_key, None)
    ca_file, _ = _write(tmp / "ca", ca, ca_key)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server_crt, server_keyfile = _write(tmp / "server", _cert("127.0.0.1", server_key, (ca, ca_key)), server_key)
    client_crt, client_keyfile = _write(tmp / "client", _cert("kvferry", client_key, (ca, ca_key)), client_key)
    port = free_port()
    part = _redis_server(
        tmp,
        "--port", "0",
        "--tls-port", str(port),
        "--tls-cert-file", server_crt,
        "--tls-key-file", server_keyfile,
        "--tls-ca-cert-file", ca_file,
        "--tls-auth-clients", "yes",
        "--requirepass", PASSWORD,
    )  # fmt: skip
    settings = {
        "KVFERRY_REDIS_PASSWORD": PASSWORD,
        "KVFERRY_REDIS_TLS_CA": ca_file,
        "KVFERRY_REDIS_TLS_CERT": client_crt,
        "KVFERRY_REDIS_TLS_KEY": client_keyfile,
    }
    url = f"rediss://127.0.0.1:{port}/0"
    try:
        _wait(redis.Redis.from_url(url, **RedisAccess.from_env(settings).client_kwargs(url)), part)
        yield url, settings
    finally:
        part.stop()


def test_rediss_with_the_ca_and_a_client_certificate(tls_redis: tuple[str, dict[str, str]]) -> None:
    url, settings = tls_redis
    access = RedisAccess.from_env(settings)
    pub = _published(url, access, pod="pod-tls")
    try:
        assert _match(url, access, ["pod-tls"]) == {"pod-tls": len(HASHES)}
        # Not verified against that CA (the system's trusts nobody here), or no client certificate, or plain
        # text to the TLS port: no answer.
        no_ca = {k: v for k, v in settings.items() if k != "KVFERRY_REDIS_TLS_CA"}
        assert _match(url, RedisAccess.from_env(no_ca), ["pod-tls"], deadline_s=0.5) is None
        no_cert = {k: v for k, v in settings.items() if "CERT" not in k and "KEY" not in k}
        assert _match(url, RedisAccess.from_env(no_cert), ["pod-tls"], deadline_s=0.5) is None
        plain = url.replace("rediss://", "redis://")
        assert _match(plain, RedisAccess(password=PASSWORD), ["pod-tls"], deadline_s=0.5) is None
    finally:
        pub.stop()
