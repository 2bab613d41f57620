"""Shared by every upstream call: the prompt's routing inputs (`PromptPlan`), the choice of workers (admission
limits, then the policy, among those predicted to meet the TTFT target when any is), and admission by predicted
TTFT (`check_ttft`, once per request)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from common.prefix.hashing import chained_block_hashes
from common.protocol import TokenIds
from common.slo import DEFAULT_SLO_SPEC, SloClass, SloClasses, parse_slo_classes
from router.decision.admission import (
    AdmissionLimits,
    RequestKV,
    concurrent_calls,
    decode_is_full,
    largest_request_tokens,
    prefill_is_full,
    ttft_verdict,
)
from router.decision.cost_model import SloTargets
from router.decision.locality import PrefixLocator
from router.decision.policy import DecodeCandidate, PrefillCandidate, RouteDecision, RoutingPolicy
from router.decision.pool import DECODE_ROLES, PREFILL_ROLES, Worker, WorkerPool
from router.decision.remote_excess import RemoteExcess
from router.decision.ttft_error import PredictionError
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

    token_ids: TokenIds
    block_hashes: list[int]
    matches: dict[str, int] | None
    block_size: int
    record: RequestRecord | None = None  # the request's timeline and trace (router/timeline.py), if kept
    request_tokens: int = 0  # KV the whole request reserves, n x (prompt + max_tokens) (0: one call's own)
    slo_class: SloClass | None = None  # the request's SLO class (None: placement ignores TTFT)
    candidates: list[Worker] | None = None  # the workers it is scored on (None: every ready one)
    # (worker, prefill side, class, queued) -> (the figures it was predicted from, the prediction, the remote
    # path's excess it includes): admission and each route read a worker's prediction again, and it holds while the
    # worker's figures do; the excess is kept so the path's measurement takes off exactly what was added
    predictions: dict[tuple[Worker, bool, str, bool], tuple[WorkerFigures, float | None, float]] = field(
        default_factory=dict
    )

    def placed_prediction(self, w: Worker, remote: bool) -> tuple[float | None, float]:
        """The prediction `w` was scored on as this prompt's placement (None: it had none), and the remote path's
        excess included in it."""
        hit = self.predictions.get((w, remote, self.slo_class.name if self.slo_class else "", True))
        return (hit[1], hit[2]) if hit is not None else (None, 0.0)


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
        rng: random.Random | None = None,
    ) -> None:
        """`opts`: deadlines, Retry-After and TTFT admission (None: the registry's defaults); `limits`: per worker;
        `rng`: what samples the candidates (with `opts.sample_workers`)."""
        opts = opts if opts is not None else RouterOptions()
        self.pool = pool
        self.slo = slo if slo is not None else parse_slo_classes(DEFAULT_SLO_SPEC)
        self.admit_by_ttft = opts.admit_by_ttft != 0
        self.ttft_error = PredictionError(opts.ttft_error_quantile)  # admission's own error, fed back
        self.remote_excess = RemoteExcess()  # the remote path's cost beyond its prediction (adaptive placement)
        self.metrics = metrics or RouterMetrics()
        self.limits = limits or AdmissionLimits.from_options(opts)
        self.policy = policy
        self.locator = locator
        self.client = client
        self.connect_timeout_s = opts.connect_timeout_s
        self.first_token_timeout_s = opts.first_token_timeout_s
        self.inter_token_timeout_s = opts.inter_token_timeout_s
        self.retry_after_s = opts.retry_after_s
        self.sample_workers = max(0, opts.sample_workers)
        self.rng = rng or random.Random()
        self.decisions: dict[str, int] = {}  # reason (or rejection) -> count, for /router/workers and benchmarks
        self._decision_counters: dict[str, Any] = {}  # reason -> its labelled counter (labels() costs per call)
        self._slo_targets: dict[str, tuple[SloClass, SloTargets]] = {}  # class name -> (the class, its targets)

    async def plan(self, token_ids: TokenIds) -> PromptPlan:
        """Hashes the prompt's blocks and asks where they are cached (a prompt under the disaggregation
        threshold prefills on its decode pod anyway, so it skips Redis)."""
        block_size = self.pool.block_size()
        hashes = chained_block_hashes(token_ids, block_size)
        if len(token_ids) < self.policy.cfg.disagg_min_prompt_tokens:
            self.metrics.prefix_lookups.labels(result="skipped").inc()
            plan = PromptPlan(token_ids, hashes, {}, block_size)
            self.choose_candidates(plan)
            return plan
        pods = [w.pod for w in self.pool.workers.values() if w.up and w.pod]
        matches = await self.locator.lookup(hashes, pods)
        if matches is None:
            if self.locator.reader is not None:
                self.metrics.redis_errors.inc()
        else:
            self.metrics.prefix_lookups.labels(result="hit" if any(matches.values()) else "miss").inc()
        plan = PromptPlan(token_ids, hashes, matches, block_size)
        self.choose_candidates(plan)
        return plan

    def choose_candidates(self, plan: PromptPlan) -> None:
        """With `sample_workers` k: the workers the request is scored on are k ready ones of each role at random
        and the k with the longest cached prefix (power of k choices); without, every ready worker."""
        k = self.sample_workers
        if k <= 0:
            return
        pool = self.pool
        picked = pool.sample(DECODE_ROLES, k, self.rng) + pool.sample(PREFILL_ROLES, k, self.rng)
        if plan.matches:
            held = sorted([(n, pod) for pod, n in plan.matches.items() if n > 0])
            for _, pod in held[-k:]:
                w = pool.by_pod(pod)
                if w is not None and w.up:
                    picked.append(w)
        plan.candidates = list(dict.fromkeys(picked))

    def _ready(
        self, plan: PromptPlan, roles: frozenset[str], exclude: set[str] | frozenset[str] = frozenset()
    ) -> list[Worker]:
        """The request's ready candidates of `roles`, less `exclude` (a retry that excludes every sampled one
        looks at the whole pool)."""
        if plan.candidates is None:
            return self.pool.ready_in(roles, exclude)
        out = [w for w in plan.candidates if w.role in roles and w.up and w.url not in exclude]
        return out if out or not exclude else self.pool.ready_in(roles, exclude)

    def route(
        self, plan: PromptPlan, max_tokens: int, exclude_decode: set[str], exclude_prefill: set[str]
    ) -> RouteDecision:
        """Chooses among the ready workers with room: 503 when no decode worker is ready, 429 when none has room."""
        decode = self._ready(plan, DECODE_ROLES, exclude_decode)
        if not decode:
            raise no_worker("decode")
        limits = self.limits
        call_tokens = len(plan.token_ids) + max_tokens
        need = RequestKV(call_tokens, max(call_tokens, plan.request_tokens), max_tokens)
        cls = plan.slo_class
        name = cls.name if cls is not None else ""
        # Each open worker's record once: its held calls read once (its fullness needs them too) and its prediction
        # made once (the TTFT filter, the policy and the placement read it).
        open_decode = [
            w.decode_candidate(self.predicted_ttft_s(plan, w, name, False), h)
            for w in decode
            if not decode_is_full(w, need, limits, h := w.held())
        ]
        if not open_decode:
            self._count("rejected-decode-full")
            raise rate_limited(
                "All decode workers are at their admission limits (queued requests, prefill tokens or KV "
                "memory); retry shortly.",
                self.retry_after_s,
            )
        prefill = self._ready(plan, PREFILL_ROLES, exclude_prefill)
        open_prefill = [
            w.prefill_candidate(self.predicted_ttft_s(plan, w, name, True), h)
            for w in prefill
            if not prefill_is_full(w, limits, h := w.held())
        ]
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
        decode_c = _meeting_ttft(plan, open_decode)
        prefill_c = _meeting_ttft(plan, open_prefill)
        decision = self.policy.choose(
            len(plan.token_ids),
            max_tokens,
            plan.block_size,
            prefill_c,
            decode_c,
            plan.matches,
            self._targets(cls) if cls is not None else None,
        )
        self._count(decision.reason)
        self._placed(plan, decision)
        return decision

    def predicted_ttft_s(
        self, plan: PromptPlan, w: Worker, slo_class: str, prefill_side: bool, queued: bool = True
    ) -> float | None:
        """The prompt's predicted TTFT as `slo_class` prefilled on `w` (`prefill_side`: then moved); None: unmeasured."""
        if w.load is None:
            return None
        figures = w.figures()
        key = (w, prefill_side, slo_class, queued)
        predictions = plan.predictions
        hit = predictions.get(key)
        if hit is not None and hit[0] is figures:
            return hit[1]
        prompt = len(plan.token_ids)
        policy = self.policy
        own = prompt - policy.matched_tokens(w.pod, plan.matches, plan.block_size, prompt)
        transfer = excess = 0.0
        if prefill_side:
            rate = policy.cfg.transfer_tokens_per_s
            if rate > 0:
                transfer = prompt / rate
            excess = self.remote_excess.excess_s
        predicted = predict_ttft_s(figures, slo_class, own, transfer + excess, queued)
        predictions[key] = (figures, predicted, excess)
        return predicted

    def _sides(self, plan: PromptPlan) -> list[tuple[Worker, bool]]:
        """The workers that could prefill this prompt and have a load to predict from: its decode pods and, where it
        may disaggregate, prefill pods."""
        prefill = self._ready(plan, PREFILL_ROLES)
        cfg = self.policy.cfg
        remote = bool(prefill) and (cfg.placement == "adaptive" or len(plan.token_ids) >= cfg.disagg_min_prompt_tokens)
        local = not remote or cfg.placement == "adaptive"
        # the decode pods are listed only where they may prefill it (a long prompt's, fixed placement: not)
        sides = [(w, False) for w in self._ready(plan, DECODE_ROLES) if w.load is not None] if local else []
        if remote:
            sides += [(w, True) for w in prefill if w.load is not None]
        return sides

    def check_ttft(self, plan: PromptPlan, cls: SloClass) -> float | None:
        """429 for a request no placement is predicted to serve within its class's target, lower classes first;
        returns the best placement's predicted TTFT (None: nothing predicted)."""
        sides = self._sides(plan)
        scale = self.ttft_error.factor(time.monotonic())

        def best(k: SloClass, queued: bool = True) -> float | None:
            preds = [p for w, r in sides if (p := self.predicted_ttft_s(plan, w, k.name, r, queued)) is not None]
            return min(preds) * scale if preds else None

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

    def _placed(self, plan: PromptPlan, decision: RouteDecision) -> None:
        """The prefilling worker counts this prompt until its snapshot does; the record keeps the first prediction,
        the one the chosen worker was scored on."""
        remote = decision.prefill is not None
        w = self.pool.workers.get(decision.prefill if remote else decision.decode)  # type: ignore[arg-type]
        if w is None:
            return
        # the policy matched the chosen worker's prefix already
        matched = decision.prefill_matched_tokens if remote else decision.decode_matched_tokens
        prefilled = w.place_prompt(time.monotonic(), len(plan.token_ids) - matched, len(plan.token_ids))
        self.metrics.prompt_cached_tokens.inc(matched)
        record = plan.record
        if record is None:
            return
        record.on_first_token.append(prefilled)
        if record.predicted_ttft_s is None:
            predicted, added = plan.placed_prediction(w, remote)
            record.predicted_ttft_s = predicted
            self._measure_prediction(record, predicted, plan.slo_class)
            self._measure_path(record, predicted, added, remote)

    def _measure_prediction(self, record: RequestRecord, predicted: float | None, cls: SloClass | None) -> None:
        """At the request's first token, its TTFT against the prediction it was admitted on (ttft_error.py)."""
        if predicted is None or cls is None or cls.ttft_s is None or not self.admit_by_ttft:
            return
        target, error = cls.ttft_s, self.ttft_error

        def measured() -> None:
            if record.ttft_s is not None:
                error.observe(time.monotonic(), record.ttft_s, predicted, target)

        record.on_first_token.append(measured)

    def _measure_path(self, record: RequestRecord, predicted: float | None, added: float, remote: bool) -> None:
        """At the request's first token, its TTFT against its raw prediction (less the `added` excess it was made
        with), by path (remote_excess.py); adaptive placement only, the one that ranks the paths against each other."""
        if predicted is None or self.policy.cfg.placement != "adaptive":
            return
        raw = predicted - added
        excess, gauge = self.remote_excess, self.metrics.remote_excess

        def measured() -> None:
            if record.ttft_s is not None:
                excess.observe(remote, record.ttft_s, raw)
                gauge.set(excess.excess_s)

        record.on_first_token.append(measured)

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

    def check_request_calls(self, calls: int, detail: str) -> None:
        """400 when the request's choices are more calls than every ready decode worker takes at once: some would
        be refused however often the request were retried."""
        cap = concurrent_calls(self.pool.decoders(), self.limits)
        if cap is not None and calls > cap:
            self._count("rejected-request-too-many-choices")
            raise bad_request(
                f"This request needs {calls} concurrent generations ({detail}), more than the decode workers take "
                f"at once: {cap} (batch slots plus waiting queue, summed over the ready workers). Lower n or send "
                "fewer prompts per request.",
                "n",
                "too_many_choices",
            )

    def _targets(self, cls: SloClass) -> SloTargets:
        """`cls`'s targets as the policy reads them, one value per class (not one per request)."""
        hit = self._slo_targets.get(cls.name)
        if hit is None or hit[0] is not cls:
            hit = self._slo_targets[cls.name] = (cls, SloTargets(cls.ttft_s, cls.itl_s))
        return hit[1]

    def _count(self, reason: str) -> None:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        counter = self._decision_counters.get(reason)
        if counter is None:
            counter = self._decision_counters[reason] = self.metrics.decisions.labels(decision=reason)
        counter.inc()


Candidate = TypeVar("Candidate", PrefillCandidate, DecodeCandidate)


def _meeting_ttft(plan: PromptPlan, candidates: list[Candidate]) -> list[Candidate]:
    """`candidates` kept to those predicted to meet the request's TTFT target, when some are (unpredicted ones
    count as meeting it)."""
    cls = plan.slo_class
    if cls is None or cls.ttft_s is None or len(candidates) < 2:
        return candidates
    target = cls.ttft_s
    meeting = [c for c in candidates if c.predicted_ttft_s is None or c.predicted_ttft_s <= target]
    return meeting or candidates
