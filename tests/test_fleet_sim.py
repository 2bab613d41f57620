"""The fleet simulator (bench/fleet_sim/) on cases small enough to work out by hand: its step times are the
capacity model's, its first tokens come with a prompt's last chunk (after the KV transfer, disaggregated), its
router is the real one (admission refuses what no worker serves in time), and the planner's decisions reach the
fleet after the pods' start-up time."""

from __future__ import annotations

import pytest

from bench.fleet_sim.fleet import Fleet, FleetConfig
from bench.fleet_sim.worker import Job, SimWorker, WorkerSpec
from bench.fleet_sim.workload import SimRequest, poisson, scale_rate
from common.capacity import StepCost
from common.slo import parse_slo_classes
from planner.sizing import Counts

COST = StepCost(base_s=0.01, per_prefill_token_s=1e-4)
SLO = parse_slo_classes("interactive:ttft=1s,itl=50ms,p=99")


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


def test_a_first_token_from_a_peer_leaves_at_the_decode_worker_s_next_step() -> None:
    # A: prefill 0.11 s, KV landed at 0.115, decoding from then on in steps of 0.01 s (boundaries 0.115 + k x 0.01).
    # B at 0.2: prefill 1,200 tokens, 0.13 s, + 6 ms of transfer: landed at 0.336, taken in (and its first token
    # sent) at the decode worker's next step boundary, 0.345: TTFT 0.145 s
    f = fleet(Counts(prefill=1, decode=1))
    f.run([SimRequest(0.0, 1000, 50), SimRequest(0.2, 1200, 3)])
    assert list(f.ttft) == pytest.approx([0.115, 0.145])


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


def shared(counts: Counts, per_gpu: int, **spec_kw) -> Fleet:  # type: ignore[no-untyped-def]
    spec = WorkerSpec(cost=COST, itl_target_s=0.05, transfer_tokens_per_s=200_000.0, **spec_kw)
    cfg = FleetConfig(worker=spec, slo=SLO, net_s=0.0, startup_s=0.0, workers_per_gpu=per_gpu)
    return Fleet(cfg, counts)


def test_two_workers_time_sharing_a_gpu_share_its_time() -> None:
    # two prompts at once, one per worker: 1,000 tokens (0.11 s alone) and 400 (0.05 s alone). On one GPU each
    # gets half of it while both run: the 400 is done at 2 x 0.05 = 0.10 s, the 1,000 when the device has done
    # both, 0.11 + 0.05 = 0.16 s
    reqs = [SimRequest(0.0, 1000, 1), SimRequest(0.0, 400, 1)]
    apart = shared(Counts(decode=2), per_gpu=1)
    together = shared(Counts(decode=2), per_gpu=2)
    a, t = apart.run(reqs), together.run(reqs)
    assert sorted(apart.ttft) == pytest.approx([0.05, 0.11])
    assert sorted(together.ttft) == pytest.approx([0.10, 0.16])
    assert len(together.devices) == 1 and a.served == t.served == 2
    # GPU-hours count GPUs: one for the two workers sharing it, two apart
    assert t.gpu_hours == pytest.approx(t.span_s / 3600) and a.gpu_hours == pytest.approx(2 * a.span_s / 3600)


def test_a_step_s_host_part_holds_no_share_of_the_gpu() -> None:
    # each step: 0.01 s of host time after its device part. The 400-token step needs 0.05 s of device (half
    # speed: done at 0.10 s, its step at 0.11 s); the 1,000 then has the GPU alone: 0.11 + 0.05 device, +0.01
    reqs = [SimRequest(0.0, 1000, 1), SimRequest(0.0, 400, 1)]
    together = shared(Counts(decode=2), per_gpu=2, host_s=0.01)
    together.run(reqs)
    assert sorted(together.ttft) == pytest.approx([0.11, 0.17])


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


def test_a_long_prompt_steps_chunk_by_chunk_and_a_joining_row_cuts_its_run() -> None:
    # 7,000 tokens alone at 2,048 a step: three full chunks (0.01 + 0.2048 s each), then 856 (0.0956 s)
    assert fleet(Counts(decode=1)).run([SimRequest(0.0, 7000, 1)]).ttft_p50_s == pytest.approx(0.74)
    spec = WorkerSpec(cost=COST, itl_target_s=0.05)
    w = SimWorker("d", "decode", spec, lambda *_: None, lambda *_: None, lambda *_: None)
    w.add(Job(0, 0.0, 7000, 7000, 1, 7001), 0.0)
    assert w.wake(0.0) == pytest.approx(3 * 0.2148)  # nothing but this prompt can change those steps
    assert w.load(0.25).queued_prefill_tokens == 7000 - 2048  # /load between them counts the steps done
    row = Job(1, 0.0, 100, 0, 5, 105)  # a peer's prefilled row whose KV lands inside the second step
    w.add(row, 0.3)
    boundary = w.cut_span(0.3, row)
    assert boundary == pytest.approx(2 * 0.2148)
    # from there the row decodes beside the prompt: the chunk one 50 ms step allows, 400 tokens
    assert w.wake(boundary) == pytest.approx(2 * 0.2148 + 0.05)
    assert w.load(boundary).queued_prefill_tokens == 7000 - 2 * 2048
