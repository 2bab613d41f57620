"""The shared GPU as time slices (bench/fleet_sim/device.py, ``slice_s``): one step runs at a time, the holder keeps
the device for its slice and between its own steps, and a step that a slice of the other worker's lands in is
stretched by that slice while the steps around it are not; the slice comes from bench/gpu_share.py's loops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fleet_sim.calibrate import fit_slice_s
from bench.fleet_sim.device import SharedDevice
from bench.fleet_sim.fleet import Fleet, FleetConfig
from bench.fleet_sim.worker import WorkerSpec
from bench.fleet_sim.workload import poisson
from common.capacity import StepCost
from common.slo import parse_slo_classes
from planner.sizing import Counts

REPO = Path(__file__).resolve().parents[1]
SHARE_RUN = REPO / "bench" / "out" / "gpu_share_h200.json"


def test_a_decode_step_is_stretched_only_while_a_prompt_step_holds_the_device() -> None:
    # slices of 8 ms. Decode steps of 5 ms back to back from 0 (the holder, its slices renewed at 8 and 16 ms while
    # nothing waits). A prompt step needing 12 ms arrives at 12 ms and waits for the slice to end at 16: the decode
    # step begun at 15 is stretched by the prompt's slice (16-24) and ends at 28 (13 ms); the next decode step runs
    # 28-32, the prompt its last 4 ms in the next slice (32-36, done), that step's last 1 ms then: 37 (9 ms); the
    # step after it runs alone again (5 ms)
    ends: dict[str, float] = {}
    device = SharedDevice(2, ends.__setitem__, members=["decode", "prefill"], slice_s=0.008)
    ends["decode"] = device.start("decode", 0.005, 0.0, 1.0)
    gaps, last, arrived, prompt_done = [], 0.0, False, -1.0
    while len(gaps) < 6:
        if not arrived and ends["decode"] > 0.012:
            arrived = True
            ends["prefill"] = device.start("prefill", 0.012, 0.012, 1.0)
        elif "prefill" in ends and ends["prefill"] <= ends["decode"]:
            prompt_done = ends.pop("prefill")
            device.release("prefill", prompt_done)  # its engine has nothing more queued
        else:
            t = ends["decode"]
            gaps.append(t - last)
            last = t
            ends["decode"] = device.start("decode", 0.005, t, 1.0)
    assert gaps == pytest.approx([0.005, 0.005, 0.005, 0.013, 0.009, 0.005])
    assert prompt_done == pytest.approx(0.036)


def test_a_newcomer_on_an_idle_device_starts_at_once_and_holds_it() -> None:
    ends: dict[str, float] = {}
    device = SharedDevice(2, ends.__setitem__, members=["a", "b"], slice_s=0.01)
    assert device.start("a", 0.004, 0.0, 1.0) == pytest.approx(0.004)
    device.release("a", 0.004)
    # nobody holds it: b starts at once, and a, coming back within b's slice, waits for its end
    assert device.start("b", 0.02, 0.005, 1.0) == pytest.approx(0.025)
    assert device.start("a", 0.004, 0.006, 1.0) == pytest.approx(0.019)
    assert ends["b"] == pytest.approx(0.029)  # b lost the 4 ms a ran in a's slice (15-19 ms)


def test_the_loops_of_gpu_share_keep_the_shares_measured_with_the_slice_fitted_to_them() -> None:
    # bench/gpu_share.py's loops replayed: the decode loop waits on each step, so it gives the device up at each
    # step's end; the chunk loop's next step is queued before its queue runs dry, so it keeps its slice
    got = json.loads(SHARE_RUN.read_text())
    slice_s = fit_slice_s([SHARE_RUN])
    step_s = {role: got[role]["alone_ms"]["mean"] / 1000 for role in ("decode", "prefill")}
    ends: dict[str, float] = {}
    device = SharedDevice(2, ends.__setitem__, members=list(step_s), slice_s=slice_s)
    for role in step_s:
        ends[role] = device.start(role, step_s[role], 0.0, 1.0)
    steps = dict.fromkeys(step_s, 0)
    span = 10.0
    while min(ends.values()) <= span:
        role = min(ends, key=lambda r: ends[r])
        steps[role] += 1
        t = ends[role]
        if role == "decode":
            device.release(role, t)
        ends[role] = device.start(role, step_s[role], t, 1.0)
    share = {role: steps[role] * step_s[role] / span for role in step_s}
    for role in step_s:
        assert share[role] == pytest.approx(got[role]["device_share"], abs=0.01), role
    assert sum(share.values()) == pytest.approx(1.0, abs=0.01)


def test_the_slice_is_what_a_shared_decode_step_waits_beyond_its_time_alone(tmp_path: Path) -> None:
    runs = []
    for name, alone, shared in (("a", 8.0, 30.0), ("b", 7.0, 31.0)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"decode": {"alone_ms": {"mean": alone}, "shared_ms": {"mean": shared}}}))
        runs.append(path)
    assert fit_slice_s(runs[:1]) == pytest.approx(0.022)
    assert fit_slice_s(runs) == pytest.approx(0.023)


def test_one_worker_on_a_time_sliced_gpu_runs_as_on_its_own() -> None:
    spec = WorkerSpec(cost=StepCost(base_s=0.01, per_prefill_token_s=1e-4), share_slice_s=0.02)
    slo = parse_slo_classes("interactive:ttft=1s,itl=50ms,p=99")
    reqs = poisson(4.0, 20.0, (100, 3000), (5, 60), seed=2)
    res = {
        per_gpu: Fleet(
            FleetConfig(worker=spec, slo=slo, net_s=0.0, startup_s=0.0, workers_per_gpu=per_gpu), Counts(decode=1)
        ).run(reqs)
        for per_gpu in (1, 2)
    }
    for field in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "output_tok_per_s", "served", "good"):
        assert getattr(res[2], field) == pytest.approx(getattr(res[1], field)), field
