"""Shared by every upstream call: the prompt's routing inputs (`PromptPlan`), the choice of workers (admission
limits, then the policy, among those predicted to meet the TTFT target when any is), and admission by predicted
TTFT (`check_ttft`, once per request)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.prefix.hashing import chained_block_hashes
from common.slo import DEFAULT_SLO_SPEC, SloClass, SloClasses, parse_slo_classes
from router.decision.admission import (
    AdmissionLimits,
    RequestKV,
    decode_is_full,
    largest_request_tokens,
    prefill_is_full,
    ttft_verdict,
)
from router.decision.cost_model import SloTargets
from router.decision.locality import PrefixLocator
from router.decision.policy import RouteDecision, RoutingPolicy
from router.decision.pool import Worker, WorkerPool
from router.decision.ttft_model import WorkerFigures, predict_ttft_s
from router.errors import bad_request, no_worker, rate_limited
from router.metrics import RouterMetrics
from router.settings import RouterOptions
from router.wire import WireClient

if TYPE_CHECKING:
    from router.timeline import RequestRecord

__all__ = ["Dispatcher", "PromptPlan"]


@dataclass
class PromptPlan:
    """Per-prompt routing inputs, computed once and shared by the prompt's n choices."""

    token_ids: list[int]
    block_hashes: list[int]
    matches: dict[str, int] | None
    block_size: int
    record: RequestRecord | None = None  # the request's timeline and trace (router/timeline.py), if kept
    request_tokens: int = 0  # KV the whole request reserves, n x (prompt + max_tokens) (0: one call's own)
    slo_class: SloClass | None = None  # the request's SLO class (None: placement ignores TTFT)


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        policy: RoutingPolicy,
        locator: PrefixLocator,
        client: WireClient,
        opts: RouterOptions | None = None,
        limits: AdmissionLimits | None = None,
        metrics: RouterMetrics | None = None,
        slo: SloClasses | None = None,
    ) -> None:
        """`opts`: deadlines, Retry-After and TTFT admission (None: the registry's defaults); `limits`: per worker."""
        opts = opts if opts is not None else RouterOptions()
        self.pool = pool
        self.slo = slo if slo is not None else parse_slo_classes(DEFAULT_SLO_SPEC)
        self.admit_by_ttft = opts.admit_by_ttft != 0
        self.metrics = metrics or RouterMetrics()
        self.limits = limits or AdmissionLimits.from_options(opts)
        self.policy = policy
        self.locator = locator
        self.client = client
        self.connect_timeout_s = opts.connect_timeout_s
        self.first_token_timeout_s = opts.first_token_timeout_s
        self.inter_token_timeout_s = opts.inter_token_timeout_s
        self.retry_after_s = opts.retry_after_s
        self.decisions: dict[str, int] = {}  # reason (or rejection) -> count, for /router/workers and benchmarks
        self._decision_counters: dict[str, Any] = {}  # reason -> its labelled counter (labels() costs per call)

    async def plan(self, token_ids: list[int]) -> PromptPlan:
        """Hashes the prompt's blocks and asks where they are cached (a prompt under the disaggregation
        threshold prefills on its decode pod anyway, so it skips Redis)."""
        block_size = self.pool.block_size()
        hashes = chained_block_hashes(token_ids, block_size)
        if len(token_ids) < self.policy.cfg.disagg_min_prompt_tokens:
            self.metrics.prefix_lookups.labels(result="skipped").inc()
            return PromptPlan(token_ids, hashes, {}, block_size)
        pods = [w.pod for w in self.pool.workers.values() if w.up and w.pod]
        matches = await self.locator.lookup(hashes, pods)
        if matches is None:
            if self.locator.reader is not None:
                self.metrics.redis_errors.inc()
        else:
            self.metrics.prefix_lookups.labels(result="hit" if any(matches.values()) else "miss").inc()
        return PromptPlan(token_ids, hashes, matches, block_size)

    def route(
        self, plan: PromptPlan, max_tokens: int, exclude_decode: set[str], exclude_prefill: set[str]
    ) -> RouteDecision:
        """Chooses among the ready workers with room: 503 when no decode worker is ready, 429 when none has room."""
        decode = self.pool.decoders(exclude_decode)
        if not decode:
            raise no_worker("decode")
        limits = self.limits
        call_tokens = len(plan.token_ids) + max_tokens
        need = RequestKV(call_tokens, max(call_tokens, plan.request_tokens), max_tokens)
        open_decode = [w for w in decode if not decode_is_full(w, need, limits)]
        if not open_decode:
            self._count("rejected-decode-full")
            raise rate_limited(
                "All decode workers are at their admission limits (queued requests, prefill tokens or KV "
                "memory); retry shortly.",
                self.retry_after_s,
            )
        prefill = self.pool.prefillers(exclude_prefill)
        open_prefill = [w for w in prefill if not prefill_is_full(w, limits)]
        # Fixed placement sends a long prompt to a prefill pod, so their being full refuses it; adaptive may not.
        if (
            prefill
            and not open_prefill
            and self.policy.cfg.placement == "fixed"
            and len(plan.token_ids) >= self.policy.cfg.disagg_min_prompt_tokens
        ):
            self._count("rejected-prefill-full")
            raise rate_limited(
                "All prefill workers are at their admission limit of queued prompt tokens; retry shortly.",
                self.retry_after_s,
            )
        cls = plan.slo_class
        name = cls.name if cls is not None else ""
        # Each open worker's prediction once: the TTFT filter, the policy and the placement read it.
        decode_preds = self._meeting_ttft(plan, open_decode, name, False)
        prefill_preds = self._meeting_ttft(plan, open_prefill, name, True)
        decision = self.policy.choose(
            len(plan.token_ids),
            max_tokens,
            plan.block_size,
            [w.prefill_candidate(p) for w, p in prefill_preds],
            [w.decode_candidate(p) for w, p in decode_preds],
            plan.matches,
            SloTargets(cls.ttft_s, cls.itl_s) if cls is not None else None,
        )
        self._count(decision.reason)
        remote = decision.prefill is not None
        placed = decision.prefill if remote else decision.decode
        predicted = next((p for w, p in (prefill_preds if remote else decode_preds) if w.url == placed), None)
        self._placed(plan, decision, predicted)
        return decision

    def predicted_ttft_s(
        self, plan: PromptPlan, w: Worker, slo_class: str, prefill_side: bool, queued: bool = True
    ) -> float | None:
        """The prompt's predicted TTFT as `slo_class` prefilled on `w` (`prefill_side`: then moved); None: unmeasured."""
        if w.load is None:
            return None
        figures, own, transfer = self._prediction_inputs(plan, w, prefill_side)
        return predict_ttft_s(figures, slo_class, own, transfer, queued)

    def _prediction_inputs(self, plan: PromptPlan, w: Worker, prefill_side: bool) -> tuple[WorkerFigures, int, float]:
        """What predicting the prompt's TTFT on `w` reads, but the class: figures, uncached tokens, transfer."""
        prompt = len(plan.token_ids)
        own = prompt - self.policy.matched_tokens(w.pod, plan.matches, plan.block_size, prompt)
        rate = self.policy.cfg.transfer_tokens_per_s
        transfer = prompt / rate if prefill_side and rate > 0 else 0.0
        return w.figures(), own, transfer

    def _sides(self, plan: PromptPlan) -> list[tuple[Worker, bool]]:
        """The workers that could prefill this prompt: its decode pods and, where it may disaggregate, prefill pods."""
        decode, prefill = self.pool.decoders(), self.pool.prefillers()
        cfg = self.policy.cfg
        remote = bool(prefill) and (cfg.placement == "adaptive" or len(plan.token_ids) >= cfg.disagg_min_prompt_tokens)
        local = not remote or cfg.placement == "adaptive"
        return [(w, False) for w in decode if local] + [(w, True) for w in prefill if remote]

    def check_ttft(self, plan: PromptPlan, cls: SloClass) -> float | None:
        """429 for a request no placement is predicted to serve within its class's target, lower classes first;
        returns the best placement's predicted TTFT (None: nothing predicted)."""
        inputs = [self._prediction_inputs(plan, w, remote) for w, remote in self._sides(plan) if w.load is not None]

        def best(k: SloClass, queued: bool = True) -> float | None:
            preds = [p for f, own, tr in inputs if (p := predict_ttft_s(f, k.name, own, tr, queued)) is not None]
            return min(preds, default=None)

        verdict = ttft_verdict(self.slo, cls, best, lambda k: best(k, queued=False))
        if verdict.shed and self.admit_by_ttft:
            self._count("rejected-ttft")
            self.metrics.slo_shed.labels(slo_class=cls.name).inc()
            why = "its" if verdict.limiting_class == cls.name else f"the higher class {verdict.limiting_class!r}'s"
            raise rate_limited(
                f"No worker is predicted to serve this {cls.name!r} request within {why} time-to-first-token "
                f"target (best predicted {verdict.excess_s:.2f} s past it); retry after {verdict.retry_after_s} s.",
                verdict.retry_after_s,
            )
        return verdict.predicted_s

    def _meeting_ttft(
        self, plan: PromptPlan, workers: list[Worker], slo_class: str, prefill_side: bool
    ) -> list[tuple[Worker, float | None]]:
        """Each worker with its predicted TTFT, kept to those meeting the target when some do."""
        preds = [(w, self.predicted_ttft_s(plan, w, slo_class, prefill_side)) for w in workers]
        cls = plan.slo_class
        if cls is None or cls.ttft_s is None or len(workers) < 2:
            return preds
        target = cls.ttft_s
        meeting = [(w, p) for w, p in preds if p is None or p <= target]
        return meeting or preds

    def _placed(self, plan: PromptPlan, decision: RouteDecision, predicted: float | None) -> None:
        """The prefilling worker counts this prompt until its snapshot does; the record keeps the first prediction."""
        remote = decision.prefill is not None
        w = self.pool.workers.get(decision.prefill if remote else decision.decode)  # type: ignore[arg-type]
        if w is None:
            return
        prompt = len(plan.token_ids)
        matched = self.policy.matched_tokens(w.pod, plan.matches, plan.block_size, prompt)
        prefilled = w.place_prompt(time.monotonic(), prompt - matched)
        self.metrics.prompt_cached_tokens.inc(matched)
        if plan.record is not None:
            plan.record.on_first_token.append(prefilled)
            if plan.record.predicted_ttft_s is None:
                plan.record.predicted_ttft_s = predicted

    def check_request_kv(self, request_tokens: int, detail: str) -> None:
        """400 when the request's KV exceeds what one request may take on every ready decode worker."""
        cap = largest_request_tokens(self.pool.decoders())
        if cap is not None and request_tokens > cap:
            self._count("rejected-request-too-large")
            raise bad_request(
                f"This request needs {request_tokens} tokens of KV memory ({detail}), more than one request may "
                f"take: {cap} tokens (KVFERRY_MAX_REQUEST_KV_SHARE of a decode worker's KV pool). Lower max_tokens "
                "or n.",
                "max_tokens",
                "request_too_large",
            )

    def _count(self, reason: str) -> None:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        counter = self._decision_counters.get(reason)
        if counter is None:
            counter = self._decision_counters[reason] = self.metrics.decisions.labels(decision=reason)
        counter.inc()
