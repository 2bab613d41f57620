"""What an engine tells its control plane about its load: the ``LoadSnapshot`` behind `/load` and the metrics,
and the decode steps' times since the last one, sent every ``LOAD_INTERVAL_S`` while busy and every
``IDLE_LOAD_INTERVAL_S`` once idle."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.engine.allocator_stats import allocator_retries
from common.gc_pauses import GcPauses
from common.protocol import LoadSnapshot
from common.sched.scheduler import Scheduler, StepEvent
from common.worker.messages import Event, Load, Steps
from common.worker.prefill_rate import PrefillRate

LOAD_INTERVAL_S = 0.1
# Idle, the load changes only with a command (which wakes the loop), so it goes out this seldom: the loop
# blocks on the command pipe in between (an idle worker costs next to no CPU).
IDLE_LOAD_INTERVAL_S = 1.0
DECODE_STEP_SMOOTHING = 0.1  # weight of the newest decode step in the published step time


@dataclass
class LoadReport:
    scheduler: Scheduler
    role: str
    pod: str
    page_size: int
    last_sent: float = 0.0  # time.monotonic() of the latest snapshot sent
    prefill_rate: PrefillRate = field(default_factory=PrefillRate)
    decode_step_s: float = 0.0  # smoothed decode-only step time, published for the router's ITL model
    steps: list[float] = field(default_factory=list)  # the decode steps' [seconds, batch size] since the last report
    gc: GcPauses = field(default_factory=GcPauses)
    device: torch.device | None = None  # the runner's: its allocator's retries are published (None: not read)

    def observe_step(self, started: float, events: list[StepEvent]) -> None:
        """A decode-only step's time and batch size: per step, never per token."""
        if (
            events
            and self.scheduler.last_step_kind() == "decode"  # not a mixed step that finished no prompt
            and all(len(e.req.output_ids) > len(e.tokens) for e in events)
        ):
            seconds = time.time() - started
            self.steps += (seconds, len(events))
            prev = self.decode_step_s
            self.decode_step_s = seconds if prev <= 0 else prev + DECODE_STEP_SMOOTHING * (seconds - prev)

    def interval(self, last_busy: float) -> float:
        """Busy, or the first snapshot after work ended (the one that shows every page back): every
        LOAD_INTERVAL_S; idle after that: every IDLE_LOAD_INTERVAL_S."""
        return LOAD_INTERVAL_S if self.last_sent <= last_busy else IDLE_LOAD_INTERVAL_S

    def next_due(self, last_busy: float) -> float:
        return self.last_sent + self.interval(last_busy)

    def due(self, loop_turns: int, now: float, last_busy: float, idle_trimmed: bool) -> list[Event]:
        """The report's events when one is due at ``now`` (time.monotonic()), else none."""
        if now < self.next_due(last_busy):
            return []
        self.last_sent = now
        self.gc.flush()  # the slow collections' log lines, written here: never from the collector's callback
        events: list[Event] = [Load(self.snapshot(loop_turns, idle_trimmed))]
        if self.steps:
            events.append(Steps(self.steps))
            self.steps = []
        return events

    def snapshot(self, loop_turns: int, idle_trimmed: bool) -> LoadSnapshot:
        snap = self.scheduler.snapshot()
        queued = snap.queued_prefill_tokens
        rate = self.prefill_rate.observe(time.monotonic(), snap.prefill_tokens_launched, queued > 0)
        return LoadSnapshot(
            role=self.role,  # type: ignore[arg-type]
            pod=self.pod,
            queued_prefill_tokens=queued,
            prefill_tokens_per_s=round(rate, 1),
            prefill_chunk_tokens=snap.prefill_chunk_tokens,
            itl_target_s=round(snap.itl_target_s, 5),
            prefill_step_tokens_per_s=round(snap.prefill_step_tokens_per_s, 1),
            decode_step_s=round(self.decode_step_s, 5),
            step_coefficients={k: float(f"{v:.4g}") for k, v in snap.step_coefficients.items()},
            step_chunk_tokens=snap.step_chunk_tokens,
            decode_rows=snap.decode_rows,
            decode_context=snap.decode_context,
            queued_ahead_tokens=snap.queued_ahead_tokens,
            running_requests=snap.running,
            waiting_requests=snap.waiting,
            free_pages=snap.free_pages,
            kv_reserve_output_tokens=snap.kv_reserve_output_tokens,
            total_pages=snap.total_pages,
            page_size=self.page_size,
            ready=True,
            loop_turns=loop_turns,
            idle_trimmed=idle_trimmed,
            host_pages_cached=snap.host_pages_cached,
            host_pages_total=snap.host_pages_total,
            host_pages_locked=snap.host_pages_locked,
            host_pages_saved=snap.host_pages_saved,
            host_pages_loaded=snap.host_pages_loaded,
            preemptions=snap.preemptions,
            preemptions_parked=snap.preemptions_parked,
            recomputed_tokens=snap.recomputed_tokens,
            step_overruns=snap.step_overruns,
            step_stalls=snap.step_stalls,
            gc_collections=self.gc.count,
            gc_pause_s=round(self.gc.total_s, 6),
            gc_pause_max_s=round(self.gc.max_s, 6),
            alloc_retries=allocator_retries(self.device) if self.device is not None else 0,
        )
