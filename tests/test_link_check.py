"""Per-peer KV transfer speed and the warning for GPU peers reached at host or network speed."""

from __future__ import annotations

import logging

from common.worker.link_check import GPU_SLOW_GB_S, MIN_BYTES, PeerLinks


def test_slow_gpu_peer_is_reported_once(caplog) -> None:
    links = PeerLinks(gpu=True)
    nbytes = 64 << 20
    with caplog.at_level(logging.WARNING, logger="kvferry.transfer"):
        for _ in range(3):
            links.observe("decode-a", nbytes, nbytes / 0.4e9)  # 0.4 GB/s: TCP with host staging
        assert not caplog.records  # too few samples yet
        for _ in range(5):
            median = links.observe("decode-a", nbytes, nbytes / 0.4e9)
        for _ in range(8):
            links.observe("decode-b", nbytes, nbytes / 1500e9)  # NVLink speed: fine
    assert median is not None and abs(median - 0.4) < 1e-6
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "decode-a" in warnings[0].getMessage()
    assert links.observe("decode-b", nbytes, nbytes / 1500e9) > GPU_SLOW_GB_S


def test_host_pools_and_small_transfers_say_nothing(caplog) -> None:
    cpu = PeerLinks(gpu=False)
    with caplog.at_level(logging.WARNING, logger="kvferry.transfer"):
        for _ in range(8):
            cpu.observe("decode-a", 64 << 20, 1.0)
    assert not caplog.records
    assert PeerLinks(gpu=True).observe("decode-a", MIN_BYTES - 1, 1.0) is None
