"""Which prefill pod and which decode pod serve a request: pure scoring over plain data.

Inputs are snapshots (router/decision/pool.py builds them from each worker's ``/load`` and the router's own
in-flight counts) plus, per pod id, how many leading prompt blocks the pod holds (Redis prefix index,
one round trip; None when Redis is down). Nothing here does I/O, so the formula is unit-tested directly.

Prefill pod p (units: prompt tokens of prefill work):

    load_p     = max(queued_prefill_tokens_p, inflight_tokens_p)
                 (the pod's own queue, ~1 s stale, vs. what this router sent it and has not seen start;
                 max, not sum: the fresher number usually already includes the other)
    uncached_p = prompt_len - matched_tokens_p
    cost_p     = prefill_load_weight * load_p + uncached_p

``uncached_p`` is the work this request adds on p; ``load_p`` is the work ahead of it. The load is
discounted (default 0.5) because chunked prefill batches queued prompts together, so waiting behind
them costs less than computing a prefix again. Lowest cost wins.

Load-imbalance guard (traffic must not collapse onto the one pod that holds a popular prefix): with
``L_min`` the smallest load, pod p is only eligible when NOT
``load_p - L_min > imbalance_abs_tokens and load_p > imbalance_ratio * L_min``.
The least-loaded pod is always eligible. Ties go round-robin.

Decode pod d (units: requests):

    active_d = max(running_d + waiting_d, inflight_requests_d)
    cost_d   = active_d + decode_kv_weight * (1 - free_pages_d / total_pages_d)

restricted to pods with enough free pages for prompt + max_tokens when any has them (a pod short of
pages would queue the request). Ties prefer the pod holding more of the prefix, then round-robin.

Conditional disaggregation: the decode pod prefills locally (``prefill`` None) when no prefill pod is
up, when the prompt is shorter than ``disagg_min_prompt_tokens`` (the KV transfer and the extra hop cost
more than they save), or when the chosen decode pod already holds most of the prefix (matched >=
``local_prefix_fraction`` of the prompt: only a short suffix is left to compute, and decode pods publish
the blocks they received or computed, so a conversation's next turn often finds its prefix there).
``local_prefix_fraction`` > 1 turns that last rule off.

Without prefix information (``matches`` None: Redis down) every matched length is 0 and routing is on
load alone.

Mixed pods (role ``mixed``: they decode and prefill for peers) are candidates on both sides; a request's
decode pod is never also its remote prefill pod (that is the local placement).

Adaptive placement (``placement="adaptive"``; ``fixed``, the default, until a GPU benchmark shows adaptive
wins): once the pods have measured their prefill rates, router/decision/cost_model.py makes the local or
disaggregated choice (reasons ``adaptive-local`` / ``adaptive-disaggregated``, ``-slo-miss`` when no placement
met both SLOs) in place of the two thresholds above.

``mode="round_robin"`` picks prefill pods in turn, ignoring prefix and load: the baseline that
bench/prefix_routing.py compares against (and a fallback switch for operators).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common import settings_registry as reg
from router.decision.cost_model import LocalSide, PrefillSide, SloTargets, choose_placement

__all__ = ["DecodeCandidate", "PolicyConfig", "PrefillCandidate", "RouteDecision", "RoutingPolicy"]


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
    # assumed where a pod has no TTFT prediction (cost_model.py)
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

    # ---- the decision -------------------------------------------------------------------------------
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
        """Raises ValueError when there is no decode candidate (the caller answers 503 before this). `targets`:
        the request's SLO class's (None: `PolicyConfig.targets`)."""
        if not decode:
            raise ValueError("no decode candidate")
        turn = next(self._turn)
        d = self.pick_decode(prompt_len, max_tokens, block_size, decode, matches, turn)
        d_matched = self.matched_tokens(d.pod, matches, block_size, prompt_len)
        cfg = self.cfg
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
        """The cost model's choice for decode pod ``d``; None until the pods have measured their rates."""
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
            )
            for c in prefill
        ]
        chosen = choose_placement(local, sides, prompt_len, targets, self.cfg.transfer_tokens_per_s)
        if chosen is None:
            return None
        matched = p_matched[chosen.prefill] if chosen.prefill is not None else 0
        return RouteDecision(d.key, chosen.prefill, chosen.reason, matched, d_matched)

    # ---- prefill -----------------------------------------------------------------------------------
    def prefill_costs(
        self,
        prompt_len: int,
        block_size: int,
        prefill: Sequence[PrefillCandidate],
        matches: Mapping[str, int] | None,
    ) -> list[tuple[float, bool, int]]:
        """Per candidate: (cost, eligible under the imbalance guard, matched tokens)."""
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

    # ---- decode ------------------------------------------------------------------------------------
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
    ) -> DecodeCandidate:
        fits = [c for c in decode if c.free_pages * max(1, c.page_size) >= prompt_len + max_tokens]
        pool = fits or list(decode)
        n = len(pool)
        best: DecodeCandidate | None = None
        best_key: tuple[float, int] | None = None
        for k in range(n):
            c = pool[(turn + k) % n]
            key = (self.decode_cost(c), -self.matched_tokens(c.pod, matches, block_size, prompt_len))
            if best_key is None or key < best_key:
                best, best_key = c, key
        assert best is not None
        return best

    @staticmethod
    def matched_tokens(pod: str | None, matches: Mapping[str, int] | None, block_size: int, prompt_len: int) -> int:
        if matches is None or pod is None:
            return 0
        return min(prompt_len, matches.get(pod, 0) * block_size)
