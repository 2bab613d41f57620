"""Which prefill pod and which decode pod serve a request: pure scoring over snapshots and prefix matches, no
I/O (the formulas: docs/architecture.md, "Placement: local or disaggregated prefill, per request").
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common import settings_registry as reg
from common.capacity import StepCost
from router.decision.cost_model import LocalSide, PrefillSide, SloTargets, choose_placement

__all__ = ["DecodeCandidate", "PolicyConfig", "PrefillCandidate", "RouteDecision", "RoutingPolicy"]


# slots, not frozen: built per candidate per request, where a frozen dataclass's __init__ costs ~3x
@dataclass(slots=True)
class PrefillCandidate:
    key: str  # worker URL
    pod: str | None  # id the pod publishes to Redis under (None until its /load was read)
    queued_tokens: int = 0
    inflight_tokens: int = 0
    inflight_requests: int = 0
    prefill_tokens_per_s: float = 0.0  # measured by the pod (0: not yet)
    decoding: bool = False  # a mixed pod with a running decode batch: a prefill here slows that batch
    prefill_chunk_tokens: int = 0  # prompt tokens one of its prefill steps takes beside decoding (0: unknown)
    prefill_step_tokens_per_s: float = 0.0  # its device-timed prefill speed (0: unknown)
    decode_step_s: float = 0.0  # its recent decode step time (0: unknown)
    predicted_ttft_s: float | None = None  # this request's TTFT prefilled here, transfer included (None: unknown)
    step_cost: StepCost | None = None  # its fitted step-time model (None: not published)
    decode_rows: int = 0  # the batch it decodes now and that batch's context: what its chunks step beside
    decode_context: int = 0


@dataclass(slots=True)
class DecodeCandidate:
    key: str
    pod: str | None
    running: int = 0
    waiting: int = 0
    inflight_requests: int = 0
    free_pages: int = 1
    total_pages: int = 1
    page_size: int = 16
    queued_tokens: int = 0  # prompt tokens queued for local prefill on the pod
    prefill_tokens_per_s: float = 0.0  # its measured local prefill rate (0: not yet)
    prefill_chunk_tokens: int = 0  # prompt tokens one of its prefill steps takes beside decoding (0: unknown)
    prefill_step_tokens_per_s: float = 0.0  # its device-timed prefill speed (0: unknown)
    decode_step_s: float = 0.0  # its recent decode step time (0: unknown)
    predicted_ttft_s: float | None = None  # this request's TTFT prefilled locally here (None: unknown)
    step_cost: StepCost | None = None  # as PrefillCandidate's
    decode_rows: int = 0
    decode_context: int = 0


@dataclass(slots=True)
class RouteDecision:
    decode: str
    prefill: str | None  # None: the decode pod prefills locally
    reason: str  # disaggregated | short-prompt | decode-holds-prefix | no-prefill | adaptive-* (cost_model.py)
    prefill_matched_tokens: int = 0
    decode_matched_tokens: int = 0


@dataclass(frozen=True)
class PolicyConfig:
    disagg_min_prompt_tokens: int = reg.ROUTER_DISAGG_MIN_PROMPT_TOKENS.default
    local_prefix_fraction: float = reg.ROUTER_LOCAL_PREFIX_FRACTION.default
    prefill_load_weight: float = reg.ROUTER_PREFILL_LOAD_WEIGHT.default
    imbalance_abs_tokens: int = reg.ROUTER_IMBALANCE_ABS_TOKENS.default
    imbalance_ratio: float = reg.ROUTER_IMBALANCE_RATIO.default
    decode_kv_weight: float = reg.ROUTER_DECODE_KV_WEIGHT.default
    mode: str = reg.ROUTER_ROUTING.default  # cache_aware | round_robin
    placement: str = reg.ROUTER_PLACEMENT.default  # fixed (the thresholds only) | adaptive (cost_model.py)
    # assumed where a pod has no TTFT prediction
    transfer_tokens_per_s: float = reg.ROUTER_TRANSFER_TOKENS_PER_S.default
    targets: SloTargets = field(default_factory=lambda: SloTargets(None, 0.05))  # of a request without a class


class RoutingPolicy:
    def __init__(self, cfg: PolicyConfig | None = None) -> None:
        self.cfg = cfg or PolicyConfig()
        if self.cfg.mode not in ("cache_aware", "round_robin"):
            raise ValueError(f"unknown routing mode {self.cfg.mode!r} (cache_aware | round_robin)")
        if self.cfg.placement not in ("adaptive", "fixed"):
            raise ValueError(f"unknown placement {self.cfg.placement!r} (adaptive | fixed)")
        self._turn = itertools.count()

    def choose(
        self,
        prompt_len: int,
        max_tokens: int,
        block_size: int,
        prefill: Sequence[PrefillCandidate],
        decode: Sequence[DecodeCandidate],
        matches: Mapping[str, int] | None,
        targets: SloTargets | None = None,
    ) -> RouteDecision:
        """Raises ValueError without a decode candidate; `targets`: the request's SLO class's (None: the config's)."""
        if not decode:
            raise ValueError("no decode candidate")
        turn = next(self._turn)
        cfg = self.cfg
        # No prefill pod to take it (an aggregated fleet, or every one full): the decode pod picked prefills it.
        d, d_matched = self.pick_decode(prompt_len, max_tokens, block_size, decode, matches, turn, not prefill)
        prefill = [c for c in prefill if c.key != d.key]  # a mixed D prefilling for itself is the local case
        if not prefill:
            return RouteDecision(d.key, None, "no-prefill", 0, d_matched)
        if cfg.placement == "adaptive":
            adaptive = self.adaptive_placement(
                prompt_len, block_size, d, d_matched, prefill, matches, targets or cfg.targets
            )
            if adaptive is not None:
                return adaptive
        if prompt_len < cfg.disagg_min_prompt_tokens:
            return RouteDecision(d.key, None, "short-prompt", 0, d_matched)
        if d_matched >= cfg.local_prefix_fraction * prompt_len:
            return RouteDecision(d.key, None, "decode-holds-prefix", 0, d_matched)
        p, p_matched = self.pick_prefill(prompt_len, block_size, prefill, matches, turn)
        return RouteDecision(d.key, p.key, "disaggregated", p_matched, d_matched)

    def adaptive_placement(
        self,
        prompt_len: int,
        block_size: int,
        d: DecodeCandidate,
        d_matched: int,
        prefill: Sequence[PrefillCandidate],
        matches: Mapping[str, int] | None,
        targets: SloTargets,
    ) -> RouteDecision | None:
        local = LocalSide(
            key=d.key,
            queued_tokens=d.queued_tokens,
            uncached_tokens=prompt_len - d_matched,
            rate=d.prefill_tokens_per_s,
            chunk_tokens=d.prefill_chunk_tokens,
            busy=max(d.running, d.inflight_requests) > 0,
            step_speed=d.prefill_step_tokens_per_s,
            decode_step_s=d.decode_step_s,
            predicted_ttft_s=d.predicted_ttft_s,
            step_cost=d.step_cost,
            decode_rows=d.decode_rows,
            decode_context=d.decode_context,
        )
        p_matched = {c.key: self.matched_tokens(c.pod, matches, block_size, prompt_len) for c in prefill}
        sides = [
            PrefillSide(
                key=c.key,
                queued_tokens=max(c.queued_tokens, c.inflight_tokens),
                uncached_tokens=prompt_len - p_matched[c.key],
                rate=c.prefill_tokens_per_s,
                chunk_tokens=c.prefill_chunk_tokens,
                busy=c.decoding,
                step_speed=c.prefill_step_tokens_per_s,
                decode_step_s=c.decode_step_s,
                predicted_ttft_s=c.predicted_ttft_s,
                step_cost=c.step_cost,
                decode_rows=c.decode_rows,
                decode_context=c.decode_context,
            )
            for c in prefill
        ]
        chosen = choose_placement(local, sides, prompt_len, targets, self.cfg.transfer_tokens_per_s)
        if chosen is None:
            return None
        matched = p_matched[chosen.prefill] if chosen.prefill is not None else 0
        return RouteDecision(d.key, chosen.prefill, chosen.reason, matched, d_matched)

    def prefill_costs(
        self,
        prompt_len: int,
        block_size: int,
        prefill: Sequence[PrefillCandidate],
        matches: Mapping[str, int] | None,
    ) -> list[tuple[float, bool, int]]:
        cfg = self.cfg
        loads = [max(c.queued_tokens, c.inflight_tokens) for c in prefill]
        l_min = min(loads)
        out = []
        for c, load in zip(prefill, loads, strict=True):
            matched = self.matched_tokens(c.pod, matches, block_size, prompt_len)
            cost = cfg.prefill_load_weight * load + (prompt_len - matched)
            eligible = not (load - l_min > cfg.imbalance_abs_tokens and load > cfg.imbalance_ratio * l_min)
            out.append((cost, eligible, matched))
        return out

    def pick_prefill(
        self,
        prompt_len: int,
        block_size: int,
        prefill: Sequence[PrefillCandidate],
        matches: Mapping[str, int] | None,
        turn: int = 0,
    ) -> tuple[PrefillCandidate, int]:
        costs = self.prefill_costs(prompt_len, block_size, prefill, matches)
        n = len(prefill)
        if self.cfg.mode == "round_robin":
            i = turn % n
            return prefill[i], costs[i][2]
        best = -1
        best_key: tuple[float, int] | None = None
        for k in range(n):
            i = (turn + k) % n  # rotating start: equal keys go round-robin
            cost, eligible, _ = costs[i]
            if not eligible:
                continue
            key = (cost, prefill[i].inflight_requests)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return prefill[best], costs[best][2]

    def decode_cost(self, c: DecodeCandidate) -> float:
        active = max(c.running + c.waiting, c.inflight_requests)
        used = 1.0 - (c.free_pages / c.total_pages if c.total_pages > 0 else 0.0)
        return active + self.cfg.decode_kv_weight * max(0.0, used)

    def pick_decode(
        self,
        prompt_len: int,
        max_tokens: int,
        block_size: int,
        decode: Sequence[DecodeCandidate],
        matches: Mapping[str, int] | None,
        turn: int = 0,
        prefills_here: bool = False,
    ) -> tuple[DecodeCandidate, int]:
        """The decode pod, and the prompt tokens it holds. `prefills_here`: the pod picked prefills the prompt (no
        prefill pod takes it), so the soonest predicted first token goes first, then the cost: the prediction
        weighs the pod's prefill queue and its decode batch (a bigger batch leaves a smaller chunk), where the
        request count takes a pod with few requests and a long prompt queued for the emptiest. Four aggregated
        workers in the simulator: TTFT p99 at 0.85x saturation 0.41-0.52 -> 0.27-0.31 s with one to four router
        processes, 0.2-0.4 points more attainment at saturation, 0.6-1.6 more good requests/s past it
        (bench/RESULTS.md, "An aggregated fleet's decode pick by predicted TTFT")."""
        fits = [c for c in decode if c.free_pages * max(1, c.page_size) >= prompt_len + max_tokens]
        pool = fits or list(decode)
        n = len(pool)
        by_ttft = prefills_here and self.cfg.mode == "cache_aware" and all(c.predicted_ttft_s is not None for c in pool)
        best: DecodeCandidate | None = None
        best_key: tuple[float, float, int] | None = None
        for k in range(n):
            c = pool[(turn + k) % n]
            ttft = round(c.predicted_ttft_s, 3) if by_ttft else 0.0  # type: ignore[arg-type]
            key = (ttft, self.decode_cost(c), -self.matched_tokens(c.pod, matches, block_size, prompt_len))
            if best_key is None or key < best_key:
                best, best_key = c, key
        assert best is not None and best_key is not None
        return best, -best_key[2]

    @staticmethod
    def matched_tokens(pod: str | None, matches: Mapping[str, int] | None, block_size: int, prompt_len: int) -> int:
        if matches is None or pod is None:
            return 0
        return min(prompt_len, matches.get(pod, 0) * block_size)
