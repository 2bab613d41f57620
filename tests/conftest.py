"""Shared fixtures: one converted model, one engine, one transformers reference and one tiny random model per test
session."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest_redis import redis_server  # noqa: F401  (session-scoped real redis-server)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails (or errs in set-up or teardown) beside a running cluster gets its parts' logs' ends in
    its report: the cluster removes its own log directory when it stops, and a failure seen once in CI is
    otherwise left with no evidence."""
    from tests.helpers import LIVE_CLUSTERS, cluster_log_tails

    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for c in LIVE_CLUSTERS:
            report.sections.append((f"cluster logs ({c.log_dir})", cluster_log_tails(c)))


@pytest.fixture(scope="session")
def smol_path():
    from common.default_model import convert_default_model

    return convert_default_model()


@pytest.fixture(scope="session")
def tiny_model():
    """A small random-weight llama (tests/test_scheduler.py `build_tiny_model`), read-only, shared."""
    from tests.test_scheduler import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def smol_runner(smol_path):
    from common.engine.runner import ModelRunner, RunnerConfig

    return ModelRunner(RunnerConfig(model=str(smol_path), num_pages=1024, max_running=16))


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_path)
