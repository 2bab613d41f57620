"""The fleet simulator (bench/fleet_sim/) on cases small enough to work out by hand: its step times are the
capacity model's, its first tokens come with a prompt's last chunk (after the KV transfer, disaggregated), its
router is the real one (admission refuses what no worker serves in time), and the planner's decisions reach the
fleet after the pods' start-up time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fleet_sim.calibrate import fit_share_weights
from bench.fleet_sim.controllers import PlannerController
from bench.fleet_sim.device import SharedDevice
from bench.fleet_sim.fleet import Fleet, FleetConfig
from bench.fleet_sim.scenarios import fleet_spec
from bench.fleet_sim.worker import Job, SimWorker, WorkerSpec
from bench.fleet_sim.workload import SimRequest, poisson, ramp, scale_rate, trace_file
from planner.core import Planner
from planner.sizing import Counts, OfferedLoad
from tests.fleet_sim_cases import COST, SLO, seven_thousand_token_run, shared

REPO = Path(__file__).resolve().parents[1]


def fleet(counts: Counts, **kw) -> Fleet:  # type: ignore[no-untyped-def]
    spec = WorkerSpec(cost=COST, itl_target_s=0.05, transfer_tokens_per_s=200_000.0)
    return Fleet(FleetConfig(worker=spec, slo=SLO, net_s=0.0, startup_s=kw.pop("startup_s", 0.0), **kw), counts)


def test_one_request_on_one_worker_by_hand() -> None:
    # prompt 1,000 in one step: 0.01 + 1000 x 1e-4 = 0.11 s -> first token; 4 more decode steps of 0.01 s each
    res = fleet(Counts(decode=1)).run([SimRequest(0.0, 1000, 5)])
    assert res.ttft_p50_s == pytest.approx(0.11)
    assert res.itl_p50_s == pytest.approx(0.01, rel=0.02)  # the histogram's bin
    assert res.span_s == pytest.approx(0.15)
    assert (res.served, res.shed, res.good) == (1, 0, 1)


def test_a_long_prompt_is_chunked_and_the_second_waits() -> None:
    # 3,000 tokens at 2,048 a step: 0.01 + 0.2048 s; the second step takes the first prompt's last 952 tokens and,
    # in the budget left (1,096 >= 500), the whole second prompt: 0.01 + 0.1452 s -> both first tokens at 0.37 s
    res = fleet(Counts(decode=1)).run([SimRequest(0.0, 3000, 1), SimRequest(0.0, 500, 1)])
    assert res.ttft_p50_s == pytest.approx(0.37) and res.ttft_p99_s == pytest.approx(0.37)


def test_disaggregated_first_token_waits_for_the_transfer() -> None:
    # prefill 0.11 s on the prefill worker, then 1,000 tokens / 200k tokens/s = 5 ms of KV transfer
    res = fleet(Counts(prefill=1, decode=1)).run([SimRequest(0.0, 1000, 3)])
    assert res.ttft_p50_s == pytest.approx(0.115)


def test_the_peer_hop_delays_a_disaggregated_first_token_and_nothing_else() -> None:
    # FleetConfig.peer_hop_s: the prompt reaches its prefill worker 30 ms late, so its first token comes 30 ms later
    # (0.11 s of prefill, 5 ms of transfer); a request the decode worker prefills itself is unchanged
    reqs = [SimRequest(0.0, 1000, 3)]
    assert fleet(Counts(prefill=1, decode=1), peer_hop_s=0.03).run(reqs).ttft_p50_s == pytest.approx(0.145)
    assert fleet(Counts(decode=1), peer_hop_s=0.03).run(reqs).ttft_p50_s == pytest.approx(0.11)


def test_a_first_token_from_a_peer_leaves_at_the_decode_worker_s_next_step() -> None:
    # A: prefill 0.11 s, KV landed at 0.115, decoding from then on in steps of 0.01 s (boundaries 0.115 + k x 0.01).
    # B at 0.2: prefill 1,200 tokens, 0.13 s, + 6 ms of transfer: landed at 0.336, taken in (and its first token
    # sent) at the decode worker's next step boundary, 0.345: TTFT 0.145 s
    f = fleet(Counts(prefill=1, decode=1))
    f.run([SimRequest(0.0, 1000, 50), SimRequest(0.2, 1200, 3)])
    assert list(f.ttft) == pytest.approx([0.115, 0.145])


def test_a_busy_decode_worker_asks_its_prefill_peer_at_its_next_step_boundary() -> None:
    # the decode worker reserves a prompt's pages at a loop turn and only then asks its peer to prefill it. A: 100
    # tokens, prefilled where it decodes (0.02 s), then steps of 0.01 s. B at 0.055 is asked for at 0.06: prefill
    # 1,100 tokens, 0.12 s, done at 0.18, its KV landed 5.5 ms later: TTFT 0.1305 s (asked for at once: 0.1255)
    f = fleet(Counts(prefill=1, decode=1))
    f.run([SimRequest(0.0, 100, 40), SimRequest(0.055, 1100, 1)])
    assert list(f.ttft) == pytest.approx([0.02, 0.1305])
    idle = fleet(Counts(prefill=1, decode=1))  # an idle decode worker takes it in at once
    idle.run([SimRequest(0.055, 1100, 1)])
    assert list(idle.ttft) == pytest.approx([0.1255])


def test_the_real_admission_refuses_what_cannot_be_served_in_time() -> None:
    # 40 prompts of 2,000 tokens at once: each takes ~0.2 s of the one worker, so past the fifth or so the
    # predicted TTFT passes 1 s and the router answers 429 instead of queueing them
    reqs = [SimRequest(0.0, 2000, 1) for _ in range(40)]
    res = fleet(Counts(decode=1)).run(reqs)
    assert res.shed > 20 and res.served + res.shed == 40
    assert res.ttft_p99_s < 1.5  # those admitted are served about in time


def test_a_scaled_trace_keeps_its_shape() -> None:
    reqs = [SimRequest(0.0, 10, 1), SimRequest(10.0, 20, 2)]
    fast = scale_rate(reqs, 10.0, span_s=3.0)
    assert [(r.t, r.prompt) for r in fast] == [(0.0, 10), (1.0, 20), (1.0, 10), (2.0, 20), (2.0, 10)]


def test_pods_asked_for_become_ready_after_the_start_up_time() -> None:
    f = fleet(Counts(decode=1), startup_s=30.0)
    f.scale_to(Counts(decode=3))
    assert f.counts(include_starting=False) == Counts(decode=1) and f.counts() == Counts(decode=3)
    res = f.run(poisson(2.0, 60.0, (100, 200), (5, 10), seed=1), until=60.0)
    assert f.counts(include_starting=False) == Counts(decode=3)
    # GPU-hours count every pod from the moment it is asked for: 1 x 60 s + 2 x 60 s
    assert res.gpu_hours == pytest.approx(3 * res.span_s / 3600, rel=1e-6)


def test_the_planner_first_decides_on_a_window_it_has_read() -> None:
    # as planner/main.py: a decision on one reading would see a rate of 0 and take the first real one for a step
    spec = WorkerSpec(cost=COST, itl_target_s=0.05, transfer_tokens_per_s=200_000.0)
    ctl = PlannerController(Planner(fleet_spec(spec, 1.0, 0.05)), OfferedLoad(0.0, 150, 8))
    cfg = FleetConfig(worker=spec, slo=SLO, net_s=0.0, startup_s=0.0)
    Fleet(cfg, Counts(1, 1, 0), ctl).run(poisson(20.0, 30.0, (100, 200), (5, 10), seed=1), until=30.0)
    assert ctl.decisions[0].t == ctl.interval_s
    assert all(d.forecast_rate > 10 for d in ctl.decisions)


def test_two_prompt_steps_time_sharing_a_gpu_end_together() -> None:
    # two prompts at once, one per worker: 1,000 tokens (0.11 s alone) and 400 (0.05 s alone). On one GPU each step
    # keeps a share by the length of its kernels (one kind: by its time), 0.11 / 0.16 and 0.05 / 0.16, so both are
    # done when the device has done both: 0.16 s
    reqs = [SimRequest(0.0, 1000, 1), SimRequest(0.0, 400, 1)]
    apart = shared(Counts(decode=2), per_gpu=1)
    together = shared(Counts(decode=2), per_gpu=2)
    a, t = apart.run(reqs), together.run(reqs)
    assert sorted(apart.ttft) == pytest.approx([0.05, 0.11])
    assert sorted(together.ttft) == pytest.approx([0.16, 0.16])
    assert len(together.devices) == 1 and a.served == t.served == 2
    # GPU-hours count GPUs: one for the two workers sharing it, two apart
    assert t.gpu_hours == pytest.approx(t.span_s / 3600) and a.gpu_hours == pytest.approx(2 * a.span_s / 3600)


def test_with_one_share_per_kind_two_prompt_steps_split_the_gpu_equally() -> None:
    # exponent 0, weight 1: whatever their lengths the two steps get half the device each while both run. The 400
    # (0.05 s alone) is done at 2 x 0.05 = 0.10 s, the 1,000 (0.11 s) when the device has done both, 0.16 s
    reqs = [SimRequest(0.0, 1000, 1), SimRequest(0.0, 400, 1)]
    together = shared(Counts(decode=2), per_gpu=2, share_length_exponent=0.0)
    together.run(reqs)
    assert sorted(together.ttft) == pytest.approx([0.10, 0.16])


def test_a_step_s_host_part_holds_no_share_of_the_gpu() -> None:
    # each step: 0.01 s of host time after its device part. The 400-token step (0.05 s of device) runs alone for
    # 0.02 s; from then on beside the 1,000's (0.11 s) it keeps 0.05 / 0.16 of the device: its last 0.03 s take
    # 0.096 s, device done at 0.116, first token at 0.126. The 1,000 has done 0.066 s by then and its last 0.044 s
    # run alone while the other's host part runs: device done at 0.16, first token at 0.17 (sent at 0.02: 0.15)
    reqs = [SimRequest(0.0, 400, 1), SimRequest(0.02, 1000, 1)]
    together = shared(Counts(decode=2), per_gpu=2, host_s=0.01)
    together.run(reqs)
    assert list(together.ttft) == pytest.approx([0.126, 0.15])


def test_a_decode_step_beside_a_prompt_step_keeps_the_share_of_its_kernels() -> None:
    # a prefill and a decode worker on one GPU, a prompt step's kernels weighing 0.5 a device second against a decode
    # step's 1. A: 100 tokens, short enough to be prefilled where it decodes (0.02 s alone), then 0.01 s steps.
    # B at 0.055: the decode worker reserves its pages at its next step boundary, 0.06, and only then asks the prefill
    # worker: a 1,100-token prompt step (0.12 s, weight 0.06) beside decode steps of weight 0.01, so the decode side
    # keeps 1/7 of the device: its steps end at 0.13 and 0.20 (ITL 0.07 each), and so does B's prompt (0.12 s of
    # device in 0.14 s). B's KV lands at 0.2055 (5.5 ms), its one token: TTFT 0.1505 s
    pair = shared(Counts(prefill=1, decode=1), per_gpu=2, prefill_share_weight=0.5)
    res = pair.run([SimRequest(0.0, 100, 40), SimRequest(0.055, 1100, 1)])
    assert list(pair.ttft) == pytest.approx([0.02, 0.1505])
    assert res.itl_p50_s == pytest.approx(0.01, rel=0.025)  # the histogram's bin
    assert res.itl_p99_s == pytest.approx(0.07, rel=0.025)  # 2 of A's 39 gaps were slow, 0.07 each
    # work-conserving: the device was never idle, so all is done when its work is, 0.02 + 39 x 0.01 + 0.12 s
    assert res.span_s == pytest.approx(0.53)


def test_two_loops_on_one_device_keep_the_shares_measured() -> None:
    # bench/gpu_share.py's decode loop and prompt-chunk loop, replayed on one simulated device with the weight
    # calibrate.py derives from them: each keeps the share of the device it kept on the GPU, and together all of it
    got = json.loads((REPO / "bench" / "out" / "gpu_share_h200.json").read_text())
    weight, exponent = fit_share_weights([REPO / "bench" / "out" / "gpu_share_h200.json"])
    spec = WorkerSpec(cost=COST, prefill_share_weight=weight, share_length_exponent=exponent)
    step_s = {role: got[role]["alone_ms"]["mean"] / 1000 for role in ("decode", "prefill")}
    kind = {role: spec.share_weight(step_s[role], role == "prefill") for role in step_s}
    ends: dict[str, float] = {}
    device = SharedDevice(2, ends.__setitem__)
    for role in step_s:
        ends[role] = device.start(role, step_s[role], 0.0, kind[role])
    steps = dict.fromkeys(step_s, 0)
    span = 10.0
    while min(ends.values()) <= span:
        role = min(ends, key=lambda r: ends[r])
        steps[role] += 1
        ends[role] = device.start(role, step_s[role], ends[role], kind[role])
    share = {role: steps[role] * step_s[role] / span for role in step_s}
    for role in step_s:
        assert share[role] == pytest.approx(got[role]["device_share"], abs=0.01), role
    assert sum(share.values()) == pytest.approx(1.0, abs=0.01)


def test_one_worker_on_a_shareable_gpu_runs_as_on_its_own() -> None:
    reqs = poisson(4.0, 20.0, (100, 3000), (5, 60), seed=2)
    alone, shareable = shared(Counts(decode=1), per_gpu=1).run(reqs), shared(Counts(decode=1), per_gpu=2).run(reqs)
    for field in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "output_tok_per_s", "served", "good"):
        assert getattr(shareable, field) == pytest.approx(getattr(alone, field)), field


def test_a_pair_on_one_gpu_moves_kv_by_a_local_copy() -> None:
    # prefill 0.11 s, then the local copy: 1 ms + 1,000 tokens at 1M tokens/s = 2 ms (between GPUs: 5 ms)
    local = {"local_transfer_base_s": 0.001, "local_transfer_tokens_per_s": 1_000_000.0}
    pair = shared(Counts(prefill=1, decode=1), per_gpu=2, **local)
    assert pair.run([SimRequest(0.0, 1000, 3)]).ttft_p50_s == pytest.approx(0.112)
    apart = shared(Counts(prefill=1, decode=1), per_gpu=1, **local)
    assert apart.run([SimRequest(0.0, 1000, 3)]).ttft_p50_s == pytest.approx(0.115)


def share_run(path: Path, decode_ms: float, prefill_ms: float, decode_share: float) -> Path:
    """A bench/gpu_share.py result with the fields the fit reads."""
    run = {
        "decode": {"alone_ms": {"mean": decode_ms}, "device_share": decode_share},
        "prefill": {"alone_ms": {"mean": prefill_ms}, "device_share": 1 - decode_share},
    }
    path.write_text(json.dumps(run))
    return path


def test_the_share_weights_come_from_the_measured_shares(tmp_path: Path) -> None:
    # share ratio = weight x (prompt step / decode step) ** exponent. A 40 ms chunk beside a 10 ms decode step
    # keeping 0.8 of the device: ratio 4 at step ratio 4; a 160 ms chunk keeping 8/9: ratio 8 at 16
    short = share_run(tmp_path / "short.json", 10.0, 40.0, 0.2)
    long = share_run(tmp_path / "long.json", 10.0, 160.0, 1 / 9)
    assert fit_share_weights([short]) == pytest.approx((1.0, 1.0))  # one run: by kernel length, 4 / 4
    assert fit_share_weights([short, long]) == pytest.approx((2.0, 0.5))  # 4 = 2 x 4 ** 0.5, 8 = 2 x 16 ** 0.5


def test_a_prompt_arriving_during_a_run_shares_its_last_chunk_unless_that_step_has_started() -> None:
    # 7,000 tokens alone: steps end at 0.2148, 0.4296, 0.6444 (full chunks) and 0.74 (its last 856 tokens)
    spec = WorkerSpec(cost=COST, itl_target_s=0.05)
    w = seven_thousand_token_run(spec)
    second = Job(1, 0.3, 1000, 1000, 0, 1000)
    w.add(second, 0.3)
    assert w.cut_span(0.3, second) == pytest.approx(3 * 0.2148)  # the run ends before its last chunk
    assert w.load(0.5).queued_prefill_tokens == 8000 - 2 * 2048
    # one step takes the 856 left and the newcomer's 1,000: 0.01 + 1856 x 1e-4
    assert w.wake(3 * 0.2148) == pytest.approx(3 * 0.2148 + 0.1956)

    w = seven_thousand_token_run(spec)
    assert w.load(0.7).queued_prefill_tokens == 856  # the last chunk's step is under way
    late = Job(1, 0.7, 1000, 1000, 0, 1000)
    w.add(late, 0.7)
    assert w.cut_span(0.7, late) is None  # it waits for that step
    assert w.wake(0.74) == pytest.approx(0.74 + 0.11)


def test_a_long_prompt_steps_chunk_by_chunk_and_a_joining_row_cuts_its_run() -> None:
    # 7,000 tokens alone at 2,048 a step: three full chunks (0.01 + 0.2048 s each), then 856 (0.0956 s)
    assert fleet(Counts(decode=1)).run([SimRequest(0.0, 7000, 1)]).ttft_p50_s == pytest.approx(0.74)
    spec = WorkerSpec(cost=COST, itl_target_s=0.05)
    w = SimWorker("d", "decode", spec, lambda *_: None, lambda *_: None, lambda *_: None)
    w.add(Job(0, 0.0, 7000, 7000, 1, 7001), 0.0)
    assert w.wake(0.0) == pytest.approx(0.74)  # alone: nothing but this prompt changes its steps, its last included
    assert w.load(0.25).queued_prefill_tokens == 7000 - 2048  # /load between them counts the steps done
    row = Job(1, 0.0, 100, 0, 5, 105)  # a peer's prefilled row whose KV lands inside the second step
    w.add(row, 0.3)
    boundary = w.cut_span(0.3, row)
    assert boundary == pytest.approx(2 * 0.2148)
    # from there the row decodes beside the prompt: the chunk one 50 ms step allows, 400 tokens
    assert w.wake(boundary) == pytest.approx(2 * 0.2148 + 0.05)
    assert w.load(boundary).queued_prefill_tokens == 7000 - 2 * 2048


def test_trace_files_in_each_public_format_read_alike(tmp_path: Path) -> None:
    """Mooncake's JSON lines (compressed or not, with or without prefix blocks), Azure's and BurstGPT's CSV: the
    same requests, times from the first arrival; BurstGPT's failed requests (no response) left out."""
    import gzip

    rows = [(0.0, 300, 20), (1.5, 1200, 7), (4.25, 64, 300)]
    mooncake = tmp_path / "agent.jsonl.gz"
    with gzip.open(mooncake, "wt") as f:
        for t, n, m in rows:
            f.write(json.dumps({"timestamp": int(t * 1000), "input_length": n, "output_length": m}) + "\n")
    azure = tmp_path / "code.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{46 + t:09.6f}0,{n},{m}\n" for t, n, m in rows)
    )
    burstgpt = tmp_path / "burst.csv"
    burstgpt.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        + "".join(f"{100 + t},ChatGPT,{n},{m},{n + m},Conversation log\n" for t, n, m in rows)
        + "101.0,ChatGPT,500,0,500,Conversation log\n"  # failed: no response
    )
    want = [(t, n, m) for t, n, m in rows]
    for path in (mooncake, azure, burstgpt):
        got = [(round(r.t, 3), r.prompt, r.output) for r in trace_file(path)]
        assert got == want, path.name
    with_blocks = tmp_path / "conv.jsonl"
    with_blocks.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]}))
    assert trace_file(with_blocks)[0].blocks == (7, 8)
    other = tmp_path / "other.csv"
    other.write_text("when,in,out\n1,2,3\n")
    with pytest.raises(ValueError, match="BurstGPT"):
        trace_file(other)


def test_a_ramp_rises_to_its_rate_and_holds_it() -> None:
    base = [SimRequest(float(t), 100, 10) for t in range(10)]
    reqs = ramp(base, at_s=100.0, length_s=1000.0, extra_rate=2.0, until_s=3000.0)
    extra = [r for r in reqs if r.t >= 100.0]
    assert all(r.prompt == 100 and r.output == 10 for r in extra)
    rising = sum(1 for r in extra if r.t < 1100.0)
    held = sum(1 for r in extra if r.t >= 1100.0)
    assert 800 < rising < 1200  # the mean of 0 -> 2 req/s over 1000 s
    assert 3600 < held < 4400  # 2 req/s over 2000 s


def test_calibration_on_another_card_fits_its_microbenchmarks_and_predicts_its_own_run(tmp_path: Path) -> None:
    """`calibrate.py --card C` reads C's step microbenchmarks and predicts C's four-rate run, its constants fitted
    to that run's lowest rate: here the H200's files under another card's names, so the fit must come out as the
    H200's and every point of the run is predicted."""
    import shutil
    import subprocess
    import sys

    out_dir = REPO / "bench" / "out"
    renames = {
        "roofline_h200.json": "roofline_c9.json",
        "mixed_step_h200_graphs.json": "mixed_step_c9_graphs.json",
        "serve_agg4_trim_h200.json": "serve_agg_calib_c9.json",
        "transfer_cuda_llama8b_h200.json": "transfer_cuda_llama8b_h200.json",
        "gpu_share_h200.json": "gpu_share_h200.json",
        "serve_pd_shared_h200.json": "serve_pd_shared_c9.json",  # the P+D pair on one GPU, predicted too
    }
    for src, dst in renames.items():
        shutil.copy(out_dir / src, tmp_path / dst)
    out = tmp_path / "cal.json"
    cmd = [sys.executable, str(REPO / "bench/fleet_sim/calibrate.py"), "--runs", str(tmp_path), "--card", "c9"]
    subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True, timeout=120)
    got = json.loads(out.read_text())
    h200 = json.loads((out_dir / "fleet_sim_calibration.json").read_text())
    assert got["card"] == "c9" and got["fitted_on"].startswith("serve_agg_calib_c9.json")
    assert got["step_cost"] == pytest.approx(h200["step_cost"], rel=1e-6)
    agg = [p for p in got["points"] if p["simulated"] == "agg"]
    assert [p["rate"] for p in agg] == [6.0, 12.0, 18.0, 24.0]
    first = agg[0]  # the fitted point: its median ITL is what the host time was fitted to
    assert first["predicted"]["itl_p50_ms"] == pytest.approx(first["measured"]["itl_p50_ms"], rel=0.05)
    # the pair's path beyond the simulated hop and copy, fitted to its lowest rate's median TTFT under equal shares
    pair = [p for p in got["points"] if p["simulated"] == "disagg-shared-equal"]
    assert [p["rate"] for p in pair] == [3.0, 6.0, 9.0, 12.0] and got["peer_hop_s"] > 0
    assert pair[0]["predicted"]["ttft_p50_ms"] == pytest.approx(pair[0]["measured"]["ttft_p50_ms"], rel=0.03)
    simulated = {p["simulated"] for p in got["points"]}
    assert simulated == {"agg", "disagg-shared-equal", "disagg-shared", "disagg-shared-sliced"}  # no mixed run


def test_chunk_noise_stretches_and_shrinks_chunk_steps_beside_decoding_only() -> None:
    """WorkerSpec.chunk_noise: a chunk step beside decoding takes a measured relative error in turn, so the gaps
    it makes spread around the cost model's time; a prompt step alone, and decode steps, stay exact."""
    from dataclasses import replace

    # A decodes 40 tokens in 0.01 s steps; B's 300-token prompt arrives mid-way and rides one chunk step
    # (0.01 + 300 x 1e-4 = 0.04 s beside A's row) that the noise makes 0.06 or 0.02 s.
    reqs = [SimRequest(0.0, 100, 40), SimRequest(0.1, 300, 2)]
    exact = fleet(Counts(decode=1)).run(reqs)
    spec = WorkerSpec(cost=COST, itl_target_s=0.05, transfer_tokens_per_s=200_000.0)
    for noise, gap in ((0.5, 0.06), (-0.5, 0.02)):
        cfg = FleetConfig(worker=replace(spec, chunk_noise=(noise,)), slo=SLO, net_s=0.0, startup_s=0.0)
        got = Fleet(cfg, Counts(decode=1)).run(reqs)
        assert got.ttft_p50_s != exact.ttft_p50_s  # B's first token came with the noisy chunk step
        assert got.itl_p99_s == pytest.approx(max(gap, 0.01), rel=0.03), (noise, got.itl_p99_s)
        assert got.itl_p50_s == pytest.approx(exact.itl_p50_s)  # A's decode steps: exact
    # alone, the first prompt's step is exact with any noise (nothing decodes beside it)
    alone = Fleet(FleetConfig(worker=replace(spec, chunk_noise=(0.5,)), slo=SLO, net_s=0.0), Counts(decode=1))
    assert alone.run([SimRequest(0.0, 1000, 1)]).ttft_p50_s == pytest.approx(0.11)


def test_mixed_workers_time_sharing_a_gpu_learn_its_slowdown_and_keep_the_itl_target(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two mixed workers on one GPU: each step runs about twice as long as alone while the other steps too. The
    engine's live step model learns that from the steps it times, so its chunks shrink to keep the ITL target; a
    budget sized for a GPU alone makes every chunk step about twice the target (the served pair of `46m` held it:
    ITL p99 31.7-39.1 ms against 50)."""
    import bench.fleet_sim.worker as worker_module

    reqs = poisson(2.0, 40.0, (500, 2000), (50, 200), seed=3)
    equal = {"prefill_share_weight": 1.0, "share_length_exponent": 0.0}
    learned = shared(Counts(mixed=2), per_gpu=2, **equal).run(reqs)
    monkeypatch.setattr(worker_module, "SHARED_SLOWDOWN_GAIN", 0.0)
    alone_budget = shared(Counts(mixed=2), per_gpu=2, **equal).run(reqs)
    assert alone_budget.served == len(reqs) and learned.served >= 0.95 * len(reqs)
    # no margin here (spread 0) and an average slowdown: some chunk steps beside the other's still run past it
    assert learned.itl_p99_s <= 0.05 * 1.3 < 0.05 * 1.8 <= alone_budget.itl_p99_s
    assert learned.good >= 5 * alone_budget.good
