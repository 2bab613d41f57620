"""The placement cost model (router/decision/cost_model.py) and its use in router/decision/policy.py: pure functions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.capacity import StepCost
from router.decision.cost_model import (
    LocalSide,
    PrefillSide,
    SloTargets,
    choose_placement,
    disagg_ttft_s,
    local_itl_cost_s,
    local_ttft_s,
    with_fleet_prior,
)
from router.decision.policy import DecodeCandidate, PolicyConfig, PrefillCandidate, RoutingPolicy

SLO = SloTargets(ttft_s=2.0, itl_s=0.025)
TRANSFER = 100_000.0  # tokens/s


def local(queued: int = 0, uncached: int = 1000, rate: float = 10_000.0, chunk: int = 512, busy: bool = True):
    return LocalSide("d0", queued, uncached, rate, chunk, busy)


def remote(key: str = "p0", queued: int = 0, uncached: int = 1000, rate: float = 40_000.0) -> PrefillSide:
    return PrefillSide(key, queued, uncached, rate)


def test_formulas() -> None:
    d = local(queued=3000, uncached=1000, rate=10_000.0, chunk=512)
    assert local_ttft_s(d) == pytest.approx(0.4)
    assert local_itl_cost_s(d) == pytest.approx(0.0512)  # one 512-token chunk at 10k tokens/s
    assert local_itl_cost_s(local(uncached=100, chunk=512)) == pytest.approx(0.01)  # a chunk is at most the prompt
    assert local_itl_cost_s(local(busy=False)) == 0.0  # nothing running on D: no batch to slow
    assert local_itl_cost_s(local(chunk=0)) == pytest.approx(0.1)  # chunk unknown: the whole prompt
    # (queued + uncached) / rate + prompt / transfer rate
    assert disagg_ttft_s(remote(queued=4000, uncached=2000, rate=20_000.0), 3000, TRANSFER) == pytest.approx(0.33)


def test_idle_decode_pod_prefills_locally() -> None:
    # D runs nothing and prefills as fast as P: a local prefill hurts no ITL and skips the transfer.
    chosen = choose_placement(local(busy=False), [remote(rate=10_000.0)], 1000, SLO, TRANSFER)
    assert chosen is not None and chosen.prefill is None and chosen.reason == "adaptive-local"


def test_busy_decode_pod_with_big_chunks_disaggregates() -> None:
    # 2048-token chunks at 10k tokens/s add 205 ms to each step of D's batch: over the 25 ms ITL SLO.
    chosen = choose_placement(local(uncached=3000, chunk=2048), [remote(uncached=3000)], 3000, SLO, TRANSFER)
    assert chosen is not None and chosen.prefill == "p0" and chosen.reason == "adaptive-disaggregated"
    assert chosen.itl_cost_s == 0.0 and chosen.meets_ttft


def test_small_chunks_and_a_queued_prefill_pod_stay_local() -> None:
    # 128-token chunks cost 12.8 ms per step (within ITL); P has 60k tokens queued (1.5 s + 0.3 s of work
    # + 0.03 s transfer) against 0.3 s locally: local has the lower TTFT and meets both SLOs.
    chosen = choose_placement(
        local(uncached=3000, chunk=128), [remote(queued=60_000, uncached=3000)], 3000, SLO, TRANSFER
    )
    assert chosen is not None and chosen.prefill is None and chosen.meets_itl and chosen.meets_ttft


def test_least_loaded_prefill_pod_and_its_cached_prefix_win() -> None:
    sides = [remote("p0", queued=20_000), remote("p1", queued=0, uncached=3000), remote("p2", uncached=100)]
    chosen = choose_placement(local(uncached=3000, chunk=2048), sides, 3000, SLO, TRANSFER)
    assert chosen is not None and chosen.prefill == "p2"  # holds most of the prompt, nothing queued


def test_violations_ordered_itl_miss_weighs_more_than_ttft_miss() -> None:
    # Local: 0.2 s TTFT but 205 ms per step on D's batch. P: 100k tokens queued, 2.6 s TTFT (over 2 s).
    d = local(uncached=2000, chunk=2048)
    chosen = choose_placement(d, [remote(queued=100_000, uncached=2000)], 2000, SLO, TRANSFER)
    assert chosen is not None and chosen.prefill == "p0" and chosen.reason == "adaptive-disaggregated-slo-miss"
    assert not chosen.meets_ttft and chosen.meets_itl


def test_violations_ordered_lowest_ttft_among_equal_misses() -> None:
    # Both prefill pods miss TTFT (the local one misses ITL too): the less late prefill pod wins.
    sides = [remote("p0", queued=200_000), remote("p1", queued=100_000)]
    chosen = choose_placement(local(queued=50_000, chunk=2048), sides, 1000, SLO, TRANSFER)
    assert chosen is not None and chosen.prefill == "p1" and not chosen.meets_ttft
    # No prefill pod at all: local, even though it misses both.
    alone = choose_placement(local(queued=50_000, chunk=2048), [], 1000, SLO, TRANSFER)
    assert alone is not None and alone.prefill is None and alone.reason == "adaptive-local-slo-miss"


def test_missing_measurements_fall_back() -> None:
    assert choose_placement(local(rate=0.0), [remote(rate=0.0)], 1000, SLO, TRANSFER) is None  # nobody has measured
    assert choose_placement(local(), [remote(rate=0.0)], 1000, SLO, TRANSFER) is None  # no prefill pod has
    # An unmeasured prefill pod is left out while another one has a rate.
    chosen = choose_placement(local(chunk=4096), [remote("p0", rate=0.0), remote("p1")], 1000, SLO, TRANSFER)
    assert chosen is not None and chosen.prefill == "p1"


def _policy(placement: str) -> RoutingPolicy:
    return RoutingPolicy(PolicyConfig(placement=placement, transfer_tokens_per_s=TRANSFER, targets=SLO))


def test_policy_uses_the_cost_model_when_adaptive() -> None:
    # A 100-token prompt is "short" for the fixed rules (local), but D is busy and prefills slowly
    # (200 tokens/s: 0.5 s per step for 100 tokens), so adaptive sends it to the idle prefill pod.
    d = DecodeCandidate("d0", "pod-d", running=4, free_pages=100, total_pages=100, prefill_tokens_per_s=200.0)
    p = PrefillCandidate("p0", "pod-p", prefill_tokens_per_s=5000.0)
    fixed = _policy("fixed").choose(100, 16, 16, [p], [d], None)
    assert fixed.prefill is None and fixed.reason == "short-prompt"
    adaptive = _policy("adaptive").choose(100, 16, 16, [p], [d], None)
    assert adaptive.prefill == "p0" and adaptive.reason == "adaptive-disaggregated"


def test_policy_falls_back_to_fixed_rules_until_measured() -> None:
    d = DecodeCandidate("d0", "pod-d", running=4, free_pages=100, total_pages=100)  # no rate yet
    p = PrefillCandidate("p0", "pod-p")  # nor here
    assert _policy("adaptive").choose(100, 16, 16, [p], [d], None).reason == "short-prompt"
    assert _policy("adaptive").choose(1000, 16, 16, [p], [d], None).reason == "disaggregated"
    assert _policy("adaptive").choose(1000, 16, 16, [], [d], None).reason == "no-prefill"


def test_a_decode_pod_that_never_prefilled_borrows_the_prefill_pods_rate() -> None:
    """Under the fixed rules a decode pod may never prefill (every prompt long enough to disaggregate), so it
    never measures a rate: adaptive placement takes the prefill pods' median for it instead of staying fixed."""
    idle = DecodeCandidate("d0", "pod-d", free_pages=100, total_pages=100)
    p = PrefillCandidate("p0", "pod-p", prefill_tokens_per_s=40_000.0, prefill_step_tokens_per_s=50_000.0)
    assert _policy("adaptive").choose(2000, 16, 16, [p], [idle], None).reason == "adaptive-local"  # no transfer
    busy = DecodeCandidate("d0", "pod-d", running=8, free_pages=100, total_pages=100, prefill_chunk_tokens=2048)
    # 2048 tokens at the borrowed 50k tokens/s: 41 ms per step of D's batch, over the 25 ms ITL target.
    assert _policy("adaptive").choose(2000, 16, 16, [p], [busy], None).reason == "adaptive-disaggregated"
    prior = with_fleet_prior(
        local(rate=0.0), [remote("p0", rate=10.0), remote("p1", rate=30.0), remote("p2", rate=20.0)]
    )
    assert prior.rate == 20.0


def test_itl_is_the_decode_step_plus_one_chunk_at_the_device_timed_speed() -> None:
    d = LocalSide("d0", 0, 4000, rate=10_000.0, chunk_tokens=512, busy=True, step_speed=51_200.0, decode_step_s=0.008)
    assert local_itl_cost_s(d) == pytest.approx(0.018)  # 8 ms step + 512 tokens at 51.2k tokens/s
    # An ITL-capped pod (its chunk is what fits its target) meets a target its uncapped twin misses.
    capped = choose_placement(d, [remote(uncached=4000, rate=10_000.0)], 4000, SLO, TRANSFER)
    assert capped is not None and capped.prefill is None and capped.meets_itl
    uncapped = LocalSide("d0", 0, 4000, 10_000.0, 2048, True, step_speed=51_200.0, decode_step_s=0.008)
    chosen = choose_placement(uncapped, [remote(uncached=4000, rate=10_000.0)], 4000, SLO, TRANSFER)
    assert chosen is not None and chosen.prefill == "p0"


def test_a_pod_with_a_step_model_prices_the_gap_as_its_budget_planned_it() -> None:
    """Two mixed pods on one H100: each published a step model, a 1,056-token chunk that model sizes to its 40.7 ms
    budget, a 11.5 ms decode step and 26.6k prompt tokens a second over whole chunk steps. The speed formula counts
    the step's fixed part twice (51 ms: an ITL miss, so an idle peer took the prompt); the model gives the step the
    pod's scheduler runs, within a 50 ms target, and the lower TTFT decides."""
    cost = StepCost(base_s=0.01185, per_prefill_token_s=2.405e-05, per_decode_row_s=4.209e-04)
    fields = dict(busy=True, step_speed=26_606.0, decode_step_s=0.0115)
    speed_only = LocalSide("m0", 0, 3000, 11_000.0, 1056, **fields)  # type: ignore[arg-type]
    assert local_itl_cost_s(speed_only) == pytest.approx(0.0512, abs=2e-4)
    modelled = replace(speed_only, step_cost=cost, decode_rows=8, decode_context=8 * 1500)
    # 11.85 ms + 8 rows x 0.42 ms + 1,056 tokens x 24.05 us
    assert local_itl_cost_s(modelled) == pytest.approx(0.01185 + 8 * 4.209e-4 + 1056 * 2.405e-5)
    slo = SloTargets(ttft_s=1.0, itl_s=0.05)
    idle_peer = PrefillSide("m1", 0, 3000, 11_000.0, chunk_tokens=1056)  # decoding nothing: no gap to open
    fast_local = replace(modelled, predicted_ttft_s=0.15)
    peer = replace(idle_peer, predicted_ttft_s=0.22)  # transfer included
    before = choose_placement(replace(fast_local, step_cost=None), [peer], 3000, slo, TRANSFER)
    assert before is not None and before.prefill == "m1"  # the local "miss" sent it away
    after = choose_placement(fast_local, [peer], 3000, slo, TRANSFER)
    assert after is not None and after.prefill is None and after.meets_itl and after.reason == "adaptive-local"
    # a model that says the chunk does not fit (the budget's floor, or a target tighter than the pod's) still misses
    tight = choose_placement(fast_local, [peer], 3000, SloTargets(ttft_s=1.0, itl_s=0.03), TRANSFER)
    assert tight is not None and tight.prefill == "m1"


def test_a_busy_mixed_prefill_pod_costs_its_own_batch_itl() -> None:
    """A mixed pod prefilling for a peer slows its own decode batch the way a local prefill would: a prefill
    pod that decodes nothing is preferred, and between two busy pods the ITL misses tie and TTFT decides."""
    d = local(uncached=3000, chunk=2048)  # misses ITL locally (205 ms per step)
    busy_mixed = PrefillSide("m1", 0, 3000, 40_000.0, chunk_tokens=2048, busy=True)
    idle_prefill = PrefillSide("p0", 0, 3000, 20_000.0)
    chosen = choose_placement(d, [busy_mixed, idle_prefill], 3000, SLO, TRANSFER)
    assert chosen is not None and chosen.prefill == "p0" and chosen.meets_itl
    both_busy = choose_placement(d, [busy_mixed], 3000, SLO, TRANSFER)
    assert both_busy is not None and both_busy.prefill == "m1" and not both_busy.meets_itl  # 4x faster prefill


def test_the_decode_pod_is_never_its_own_remote_prefill_pod() -> None:
    m0 = DecodeCandidate("m0", "pod-m0", free_pages=100, total_pages=100, prefill_tokens_per_s=5000.0)
    m1 = DecodeCandidate("m1", "pod-m1", running=3, free_pages=100, total_pages=100, prefill_tokens_per_s=5000.0)
    as_prefill = [PrefillCandidate(c.key, c.pod, prefill_tokens_per_s=c.prefill_tokens_per_s) for c in (m0, m1)]
    for placement in ("fixed", "adaptive"):
        decision = _policy(placement).choose(2000, 16, 16, as_prefill, [m0, m1], None)
        assert decision.decode == "m0" and decision.prefill != "m0", decision


def test_policy_rejects_unknown_placement() -> None:
    with pytest.raises(ValueError, match="placement"):
        _policy("sometimes")


def test_a_pods_ttft_prediction_decides_over_its_rate_formula() -> None:
    """Where a pod publishes its step model, the dispatcher's prediction (the one admission uses) is the TTFT:
    by rates alone D looks fast (0.1 s), but its predicted queue says 3 s, past the 2 s target."""
    d = LocalSide("d0", 0, 1000, 10_000.0, 512, busy=False, predicted_ttft_s=3.0)
    p = PrefillSide("p0", 0, 1000, 10_000.0, predicted_ttft_s=0.6)
    chosen = choose_placement(d, [p], 1000, SLO, TRANSFER)
    assert chosen is not None and chosen.prefill == "p0" and chosen.ttft_s == 0.6 and chosen.meets_ttft
    assert local_ttft_s(LocalSide("d0", 0, 1000, 0.0, 512, busy=False, predicted_ttft_s=0.2)) == 0.2  # no rate needed


def test_the_requests_own_class_targets_place_it() -> None:
    """The same pods, two classes: a tight ITL target keeps the prompt off D's running batch (its 18 ms chunk
    steps miss 10 ms), a looser one lets D prefill it itself, sooner; a class without a TTFT target never
    misses one."""
    d = LocalSide("d0", 0, 4000, 10_000.0, 512, busy=True, step_speed=51_200.0, decode_step_s=0.008)
    d = replace(d, predicted_ttft_s=0.3)
    p = PrefillSide("p0", 0, 4000, 10_000.0, predicted_ttft_s=0.5)
    tight = choose_placement(d, [p], 4000, SloTargets(ttft_s=1.0, itl_s=0.010), TRANSFER)
    loose = choose_placement(d, [p], 4000, SloTargets(ttft_s=1.0, itl_s=0.050), TRANSFER)
    assert tight is not None and tight.prefill == "p0"
    assert loose is not None and loose.prefill is None
    batch = choose_placement(replace(d, predicted_ttft_s=30.0), [p], 4000, SloTargets(None, 0.050), TRANSFER)
    assert batch is not None and batch.meets_ttft and batch.prefill == "p0"  # lowest TTFT among equals


def test_policy_places_by_the_targets_it_is_given() -> None:
    d = DecodeCandidate("d0", "pod-d", running=4, free_pages=100, total_pages=100, prefill_tokens_per_s=10_000.0)
    d = replace(d, prefill_chunk_tokens=512, prefill_step_tokens_per_s=51_200.0, decode_step_s=0.008)
    d = replace(d, predicted_ttft_s=0.3)
    p = PrefillCandidate("p0", "pod-p", prefill_tokens_per_s=10_000.0, predicted_ttft_s=0.5)
    policy = _policy("adaptive")
    assert policy.choose(4000, 16, 16, [p], [d], None, SloTargets(1.0, 0.010)).prefill == "p0"
    assert policy.choose(4000, 16, 16, [p], [d], None, SloTargets(1.0, 0.050)).prefill is None
