"""Worker settings read from the environment: the GPU kernel switches documented in docs/architecture.md."""

from __future__ import annotations

import pytest

from common.config import WorkerConfig


def test_gpu_kernel_switches_default_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFERRY_FUSED_KERNELS", raising=False)
    monkeypatch.delenv("KVFERRY_GEMV_MAX_ROWS", raising=False)
    monkeypatch.delenv("KVFERRY_PDL", raising=False)
    runner = WorkerConfig.from_env("decode").runner
    assert runner.fused_kernels is True
    assert runner.gemv_max_rows == 8
    assert runner.gemv_prologues is False  # measured slower on the H200: never the default
    assert runner.pdl is True  # programmatic dependent launches where the GPU has them (Hopper and later)


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_fused_kernels_off_and_gemv_rows(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KVFERRY_FUSED_KERNELS", value)
    monkeypatch.setenv("KVFERRY_GEMV_MAX_ROWS", "2")
    monkeypatch.setenv("KVFERRY_PDL", value)
    runner = WorkerConfig.from_env("prefill").runner
    assert runner.fused_kernels is False
    assert runner.gemv_max_rows == 2
    assert runner.pdl is False


def test_warm_up_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFERRY_WARM_UP", raising=False)
    assert WorkerConfig.from_env("decode").warm_up == "auto"  # on a GPU only (common/worker/engine_host.py)
    monkeypatch.setenv("KVFERRY_WARM_UP", "off")
    assert WorkerConfig.from_env("mixed").warm_up == "off"
    monkeypatch.setenv("KVFERRY_WARM_UP", "sometimes")
    with pytest.raises(ValueError, match="KVFERRY_WARM_UP"):
        WorkerConfig.from_env("decode")
