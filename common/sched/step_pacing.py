"""How long the scheduler's steps take, learnt from their device times, and so the ITL a step beside decoding aims
at and the prompt tokens the next step takes (common/sched/prefill_budget.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from common.sched.itl_trim import OVERRUNS_PER_TAIL, ItlTrim, learnt_step_s
from common.sched.launched import Launched
from common.sched.prefill_budget import (
    FLOOR_DECODE_STEPS,
    PrefillSpeed,
    StepContext,
    StepSeconds,
    prefill_budget,
    within_graphs,
)
from common.sched.request_table import RequestTable
from common.sched.step_model import StepTimeModel, z_score
from common.sched.step_trace import StepTrace
from common.settings import ITL_TARGET_SLO, SchedulerConfig
from common.slo import SloClasses

__all__ = ["StepPacing"]

log = logging.getLogger("kvferry.sched")

# A step beside decoding this far past the ITL target is a gap a request's p99 may keep: one line says its shape
# and what the model predicted, at most once per SLOW_STEP_LOG_S (the trim keeps such steps to a few in ten
# thousand; the line is there to find what the model cannot see: host stalls, a batch no graph covers).
SLOW_STEP_RATIO = 1.25
SLOW_STEP_LOG_S = 10.0


@dataclass
class StepPacing:
    cfg: SchedulerConfig
    page_size: int
    slo: SloClasses
    table: RequestTable  # its decoding requests' ITL targets set the SLO target
    step_model: StepTimeModel = field(default_factory=StepTimeModel)
    prefill_speed: PrefillSpeed = field(default_factory=PrefillSpeed)
    decode_step: StepSeconds = field(default_factory=StepSeconds)
    itl_trim: ItlTrim = field(default_factory=ItlTrim)  # the share of the ITL target chunk steps aim at
    _processed_at: float | None = None  # host clock when the last step was processed
    _slow_logged_at: float = 0.0
    _slow_unlogged: int = 0  # slow steps since the last line
    _last_decoding: bool = False  # the last processed step decoded running requests
    trace: StepTrace | None = None  # KVFERRY_STEP_TRACE
    _idle_itl_s: float = 0.0  # the target while nothing decodes: every class's tightest, less the least allowance
    graphed_tokens: int = 0  # the most tokens a step runs as piecewise graphs (ModelRunner.graphed_step_tokens)
    # Host seconds the step launched just before this one was processed took to launch (overlap: it is launched
    # while this one runs, so a long launch, an eager step's, shows as this step's gap); the slow-step line says it.
    next_launch_host_s: float = 0.0

    def __post_init__(self) -> None:
        if self.cfg.step_trace and self.trace is None:
            self.trace = StepTrace(self.cfg.step_trace)
        self._idle_itl_s = min(c.engine_itl_s(self.cfg.itl_delivery_ms / 1000) for c in self.slo.classes)
        tail = 1 - max(c.percentile for c in self.slo.classes) / 100
        self.itl_trim.allow_overruns(max(tail, 1e-4) * OVERRUNS_PER_TAIL)

    def itl_target_s(self) -> float:
        """The ITL a chunk step beside decoding aims at (0: unmeasured or mixed steps off)."""
        target = self.cfg.itl_target_ms
        step = self.decode_step.seconds
        if target == ITL_TARGET_SLO:
            if step <= 0:
                return 0.0
            slo = min(self.table.decoding_itl, default=self._idle_itl_s)
            return max(slo, FLOOR_DECODE_STEPS * step)
        if target > 0:
            return target / 1000
        if target < 0:  # a multiple of the measured decode step (ITL_TARGET_AUTO: 2)
            return -target * step
        return 0.0

    def budget_target_s(self) -> float:
        return self.itl_target_s() * self.itl_trim.factor

    def margin_z(self) -> float:
        """Residual spreads of the step-time model kept below the SLO target (its percentile's normal quantile)."""
        if self.cfg.itl_target_ms != ITL_TARGET_SLO:
            return 0.0
        return z_score(max(c.percentile for c in self.slo.classes))

    def budget(self, decoding: bool, context: StepContext) -> tuple[int, str]:
        """Prompt tokens the next step takes, and why."""
        tokens, reason = prefill_budget(
            self.cfg.max_prefill_tokens,
            self.page_size,
            self.budget_target_s(),
            decoding=decoding,
            model=self.step_model,
            context=context,
            margin_z=self.margin_z(),
            prefill_tokens_per_s=self.prefill_speed.peak_tokens_per_s,
            decode_step_s=self.decode_step.seconds,
            max_step_s=self.cfg.max_step_ms / 1000,
        )
        if not decoding or not self.cfg.mixed_batching:  # prefill-first: its prompt steps carry no decode rows
            return tokens, reason
        return within_graphs(tokens, reason, context.decode_rows, self.graphed_tokens, self.page_size)

    def observe(self, launched: Launched) -> None:
        """Learns from a processed step's device time (and its period, when it ran back to back with the last)."""
        now = time.perf_counter()
        if launched.timer is not None:
            seconds = launched.timer.seconds()
            # A stream sees the period between steps, not device time; only back-to-back steps' periods are learnt.
            back_to_back = self._processed_at is not None and launched.launched_at <= self._processed_at
            period = now - self._processed_at if back_to_back and self._processed_at is not None else 0.0
            # What a decoding stream saw: the time since the last step that decoded it (a host stall between
            # steps included, which the model does not learn from).
            seen = now - self._processed_at if self._processed_at is not None and self._last_decoding else 0.0
            self._log_if_slow(launched, seconds, seen, now)
            if self.trace is not None:
                predicted = self.step_model.predict(launched.shape)
                self.trace.write(
                    launched.kind,
                    launched.shape,
                    seconds,
                    seen or period,
                    predicted,
                    self.itl_target_s(),
                    (launched.launch_host_s, launched.process_host_s),
                )
            self.step_model.observe(launched.shape, learnt_step_s(period, seconds))
            if launched.kind == "mixed":
                self.itl_trim.observe(max(seconds, period), self.itl_target_s(), seconds)
            if launched.kind == "decode":
                self.decode_step.observe(seconds)
            elif launched.kind == "prefill":
                self.prefill_speed.observe(launched.shape.prefill_tokens, seconds)
        self._processed_at = now
        self._last_decoding = launched.kind != "prefill"

    def streams_ended(self) -> None:
        """Nothing runs after the step just processed: the next step's wait is no stream's token gap (a P+D decode
        worker idle until the next request's KV lands read 1.18 s as a slow step)."""
        self._last_decoding = False

    def _log_if_slow(self, launched: Launched, seconds: float, seen: float, now: float) -> None:
        target = self.itl_target_s()
        took = max(seconds, seen)
        if launched.kind == "prefill" or target <= 0 or took <= SLOW_STEP_RATIO * target:
            return
        self._slow_unlogged += 1
        if now - self._slow_logged_at < SLOW_STEP_LOG_S:
            return
        slow, self._slow_unlogged, self._slow_logged_at = self._slow_unlogged, 0, now
        shape = launched.shape
        log.warning(
            "slow step",
            extra={
                "kind": launched.kind,
                "ms": round(took * 1e3, 1),  # since the step before (host time between steps included)
                "device_ms": round(seconds * 1e3, 1),
                "predicted_ms": round(self.step_model.predict(shape) * 1e3, 1),
                "target_ms": round(target * 1e3, 1),
                "decode_rows": shape.decode_rows,
                "prefill_tokens": shape.prefill_tokens,
                "decode_context": shape.decode_context,
                "slow_steps": slow,  # this one and those since the last line
                "next_launch_host_ms": round(self.next_launch_host_s * 1e3, 1),
            },
        )
