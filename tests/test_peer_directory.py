"""A decode worker contacts only the prefill workers it was configured with (decode_worker/peer_directory.py)."""

from __future__ import annotations

import asyncio

from decode_worker.peer_directory import PeerDirectory


def _resolve(peers: list[str], url: str) -> str | None:
    return asyncio.run(PeerDirectory(peers).resolve(url))


def test_a_configured_url_is_known_and_rebuilt_from_its_parts() -> None:
    assert _resolve(["http://10.0.0.5:8100"], "http://10.0.0.5:8100/") == "http://10.0.0.5:8100"
    assert _resolve(["http://10.0.0.5:8100"], "http://10.0.0.6:8100") is None
    assert _resolve(["http://10.0.0.5:8100"], "http://10.0.0.5:8101") is None
    assert _resolve(["http://10.0.0.5:8100"], "https://10.0.0.5:8100") is None
    assert _resolve([], "http://10.0.0.5:8100") is None


def test_anything_beyond_scheme_host_and_port_is_refused() -> None:
    peers = ["http://10.0.0.5:8100"]
    for url in (
        "http://10.0.0.5:8100/internal/evil",
        "http://10.0.0.5:8100?x=1",
        "http://user:pw@10.0.0.5:8100",
        "http://10.0.0.5",  # no port: which one would be guessed
        "file:///etc/passwd",
        "http://10.0.0.5:99999",
        "not a url",
    ):
        assert _resolve(peers, url) is None, url


def test_an_entry_without_a_port_stands_for_every_port_of_its_host() -> None:
    assert _resolve(["http://127.0.0.1"], "http://127.0.0.1:41234") == "http://127.0.0.1:41234"
    assert _resolve(["http://127.0.0.1"], "http://127.0.0.2:41234") is None


def test_a_name_stands_for_the_addresses_it_resolves_to() -> None:
    # A headless Service resolves to its pods' addresses; "localhost" to the loopback one.
    assert _resolve(["http://localhost:8100"], "http://127.0.0.1:8100") == "http://127.0.0.1:8100"
    assert _resolve(["http://localhost:8100"], "http://127.0.0.1:8200") is None
    assert _resolve(["http://no-such-service.invalid:8100"], "http://127.0.0.1:8100") is None
