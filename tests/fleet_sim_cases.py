"""Simulated workers set up by hand, shared by the fleet simulator's tests."""

from __future__ import annotations

import pytest

from bench.fleet_sim.worker import Job, SimWorker, WorkerSpec


def seven_thousand_token_run(spec: WorkerSpec) -> SimWorker:
    """A prefill worker running one 7,000-token prompt alone (base 0.01 s, 1e-4 s a token, 2,048-token chunks): its
    steps end at 0.2148, 0.4296, 0.6444 (full chunks) and 0.74 (its last 856 tokens)."""
    w = SimWorker("p", "prefill", spec, lambda *_: None, lambda *_: None, lambda *_: None)
    w.add(Job(0, 0.0, 7000, 7000, 0, 7000), 0.0)
    assert w.wake(0.0) == pytest.approx(0.74)
    return w
