"""One simulated worker: a step loop whose steps take what the capacity model says (common/capacity.py).

Like the engine's scheduler (common/sched/): every step decodes one token for each running row and, beside
them, takes prompt chunks up to a budget: with rows decoding, the largest chunk whose step the model predicts
within the ITL target less its margin (common/sched/prefill_budget.py's rule), at least MIN_PAGES pages;
alone, ``max_prefill_tokens``. A prompt's last chunk gives its first token. Its load is published to the
router as /load would (``load()``).

Granularity: a step that carries prompt tokens is one event, and so is a run of steps that each take a full
chunk of the first waiting prompt with no row decoding (nothing arriving changes those steps but a row joining,
which cuts the run at the next step boundary; /load inside a run counts the steps done by then). A prompt alone
in the queue ends its run with its last chunk (a prompt arriving before that step starts cuts the run there: the
last chunk then shares its step with the newcomer). A stretch of
pure decode steps is one event until the next row finishes (all rows then take the same step time, its context
the stretch's middle); new work arriving inside a stretch cuts it at the next step boundary. An idle worker has
no events. A worker that time-shares its GPU with others (``device``, bench/fleet_sim/device.py) takes one event
per step while another is on it: what else runs there changes each step's time, and its ITL is each step's own.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from bench.fleet_sim.device import SharedDevice
from common.capacity import StepCost, chunk_attention
from common.sched.step_model import WINDOW
from router.decision.load import Load

__all__ = ["Job", "SimWorker", "WorkerSpec"]

MIN_PAGES = 4
# a prime stride through WorkerSpec.chunk_noise: successive chunk steps take samples far apart in the trace (the
# trace's errors come in runs), the same on every run
NOISE_STRIDE = 7919
# the engine's step model fits the last WINDOW timed steps (common/sched/step_model.py): a worker time-sharing its GPU
# learns how much slower its steps run there at about that memory (an average over the window's age)
SHARED_SLOWDOWN_GAIN = 2.0 / (WINDOW + 1)
# a snapshot's queued_ahead_tokens (it reports no SLO classes): one empty map for all, which the router only reads
_NO_CLASSES: dict[str, int] = {}


@dataclass(frozen=True)
class WorkerSpec:
    cost: StepCost  # the device's step times (what the engine measures)
    host_s: float = 0.0  # host time a served step adds (sampling, events, scheduling)
    spread_s: float = 0.0  # the step-time model's residual spread (the budget's margin is z x this)
    margin_z: float = 2.326  # the normal quantile of the SLO percentile (99)
    itl_target_s: float = 0.05  # 0: prefill-first
    max_prefill_tokens: int = 2048
    max_running: int = 256
    kv_tokens: int = 885_536  # KV pool (tokens)
    page_size: int = 16
    transfer_tokens_per_s: float = 200_000.0
    # a KV transfer between two workers on one GPU is a device-local copy: its fixed time and its rate (rate 0:
    # as between GPUs)
    local_transfer_base_s: float = 0.0
    local_transfer_tokens_per_s: float = 0.0
    # on a GPU it time-shares, a step's share weight (bench/fleet_sim/device.py): its kind's (a step carrying
    # prompt tokens this, a pure decode step 1) x its device time alone ** the exponent (1: by the length of its
    # kernels; 0: one share per kind)
    prefill_share_weight: float = 1.0
    share_length_exponent: float = 1.0
    # > 0: the GPU time-slices its workers instead (device.py): a worker holds it for slices of this length while
    # another waits, and keeps it between its own steps (the engine queues its next step before the last ends)
    share_slice_s: float = 0.0
    # A served chunk step's time against the step model's prediction, as measured (relative residuals, each one
    # step's `took / predicted - 1`, bench/fleet_sim/calibrate.py `chunk_step_noise`): a chunk step beside decoding
    # takes one of them in turn, NOISE_STRIDE apart, the same order every run. Empty: every step as the cost model says.
    chunk_noise: tuple[float, ...] = ()
    # The engine on a GPU launches each step before it processes the one before (common/sched/scheduler.py
    # `step`, overlap on): step X is planned when step X-1 starts, so work that reaches a busy worker joins the
    # step after the next boundary's, one step later than a loop that plans at each boundary. Off: the CPU
    # engine's order (overlap off), and what this simulator did before.
    launch_ahead: bool = False
    # On a GPU it time-shares: a prefill worker's KV lands at its decode peer when its step in flight at the first
    # token (launched ahead) ends, not a copy's time after the first token. What the P+D pair on one H100 measured:
    # first token to "KV landed" 11 / 28 / 38 / 59 ms at 3 / 6 / 9 / 12 req/s against a ~1 ms copy alone
    # (bench/RESULTS.md, "The engine's launch ahead in the simulator").
    notice_after_step: bool = False

    @cached_property
    def published(self) -> StepCost:
        """The coefficients its /load gives: fitted to the served step period, so the host share is in the base."""
        c = self.cost
        return StepCost(
            c.base_s + self.host_s,
            c.per_prefill_token_s,
            c.per_decode_row_s,
            c.per_context_token_s,
            c.per_attention_pair_s,
        )

    @cached_property
    def published_map(self) -> dict[str, float]:
        """`published` as /load's ``step_coefficients`` (one map per spec: every snapshot shares it, read only)."""
        return self.published.as_map()

    def share_weight(self, device_s: float, prompt: bool) -> float:
        """The weight of a step needing `device_s` of the device alone on a GPU it time-shares (`prompt`: it
        carries prompt tokens)."""
        return (self.prefill_share_weight if prompt else 1.0) * device_s**self.share_length_exponent

    def transfer_s(self, tokens: int, local: bool = False) -> float:
        """A prompt's KV moving to its decode worker (`local`: on the same GPU)."""
        if local and self.local_transfer_tokens_per_s > 0:
            return self.local_transfer_base_s + tokens / self.local_transfer_tokens_per_s
        return tokens / self.transfer_tokens_per_s if self.transfer_tokens_per_s > 0 else 0.0

    @cached_property
    def prefill_rate(self) -> float:
        """Prompt tokens per second at its largest chunk, alone (what /load's prefill rates say)."""
        return self.published.prefill_rate(self.max_prefill_tokens)


@dataclass(slots=True)
class Job:
    """A request on this worker: its prompt to prefill here (``todo``) and/or its output to decode here."""

    rid: int
    arrival: float
    prompt: int
    todo: int  # prompt tokens still to compute here
    output: int  # tokens to decode here (0: a prefill-only job for a peer)
    kv: int  # KV tokens it reserves here
    done_prompt: int = 0
    first_token: float = -1.0
    join_step: int = 0
    bad_at_join: int = 0
    call: object = None  # what the router's pool holds for it
    peer: object = None  # a prefill for a peer: (decode worker, request) its KV goes to
    seen_at: float = 0.0  # when it reached this worker's engine (launch ahead: the steps it may join)


@dataclass(slots=True)  # read and written at every event: slot access is the quickest
class SimWorker:
    name: str
    role: str  # prefill | decode | mixed (agg: a decode worker with no prefill peers)
    spec: WorkerSpec
    on_first_token: Callable[[SimWorker, Job, float], None]
    on_finish: Callable[[SimWorker, Job, float, float], None]  # (worker, job, t, share of slow steps)
    record_itl: Callable[[float, float], None]  # (step seconds, tokens that waited it)
    waiting: deque[Job] = field(default_factory=deque)
    joining: list[Job] = field(default_factory=list)  # decode rows whose KV arrived, for the next step
    queued_tokens: int = 0
    reserved_kv: int = 0
    # decoding rows: finish step heap, and sums that give the KV context without a loop over rows
    rows: list[tuple[int, int, Job]] = field(default_factory=list)
    sum_prompt: int = 0
    sum_join: int = 0
    steps: int = 0
    bad_steps: int = 0  # steps longer than the ITL target so far
    held_gap_s: float = 0.0  # prefill-first: prompt steps the decode rows waited through since their last token
    # the event in flight
    busy_until: float = -1.0
    span_start: float = 0.0
    span_step_s: float = 0.0
    span_steps: int = 0
    span_chunks: list[tuple[Job, int]] = field(default_factory=list)  # per step (a prompt run: its one chunk)
    # a prompt run: each step's time and end (a run's steps differ: each chunk attends to more of its prompt)
    run_steps_s: list[float] = field(default_factory=list)
    run_ends: list[float] = field(default_factory=list)
    run_last: int = 0  # the run's last step takes its prompt's last chunk, this many tokens (0: no such step)
    version: int = 0
    busy_s: float = 0.0  # time spent stepping (what a GPU-utilisation metric reads)
    prefill_tokens_done: int = 0
    draining: bool = False
    itl_slo_s: float = 0.05  # the SLO's ITL target (what a slow step is, also for prefill-first workers)
    device: SharedDevice | None = None  # the GPU it time-shares with other workers (None: a GPU of its own)
    # prompts a peer is to prefill for it while it time-shares a GPU: (prefill worker, its job). Its engine reserves
    # their pages at its next loop turn (a step boundary) and only then asks the peer (decode_worker/routes.py); the
    # fleet gives them at its next wake (on a GPU of its own, at `next_boundary`)
    asks: list[tuple[object, Job]] = field(default_factory=list)
    span_shared: bool = False  # the step in flight runs on a GPU other workers are on
    # its steps' time on a shared GPU over their time alone, as its live step model learns it from the steps it
    # times there: the chunk budget divides the target by it, as the engine's model predicts each step that much
    # slower (1 on a GPU of its own)
    shared_slowdown: float = 1.0
    # when the step that ended last started (infinite while idle): with launch ahead, the next step was planned
    # then, so it takes only work that had reached the engine by that time
    planned_at: float = math.inf
    # notice_after_step: first tokens of prefills for peers whose KV has not landed yet: those of the steps that
    # just ended (`notices`), and those waiting for the end of the step in flight (`notices_held`)
    notices: list[tuple[Job, float]] = field(default_factory=list)
    notices_held: list[tuple[Job, float]] = field(default_factory=list)
    _noise_at: int = 0  # the last chunk noise taken (WorkerSpec.chunk_noise)
    added: int = 0  # jobs given so far
    # full prompt tokens of the jobs given to it to prefill (a peer's prefill, or its own request's), cached or
    # not: /load's prompt_tokens_accepted, as the real worker counts them (common/worker/request.py `submit`)
    prompt_tokens_accepted: int = 0
    # requests given to it to decode, counted when the router's call reaches it (before a peer's prefill): /load's
    # decodes_accepted, as the real worker counts them (decode_worker/routes.py)
    decodes_accepted: int = 0
    publishes_accepted: bool = True  # False: /load says 0 for both (a worker that does not count: no peers estimate)
    # the last snapshot and what it was taken at: (version, added, draining, a run's steps done, decodes accepted)
    # -- nothing else changes what /load says, so an unchanged worker hands the router the same snapshot again
    _last_load: tuple[tuple[int, int, bool, int, int], Load] | None = None
    _step_seq: int = 0

    # ---- what /load says ----------------------------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        return len(self.rows)

    def context(self) -> int:
        return self.sum_prompt + len(self.rows) * self.steps - self.sum_join

    def chunk_budget(self, rows: int, context: int) -> int:
        """The next step's prompt tokens beside its `rows` decode rows over `context` tokens (what `context()`
        gives: its callers have both at hand)."""
        s = self.spec
        if rows == 0 or s.itl_target_s <= 0:
            return s.max_prefill_tokens
        start = self.waiting[0].done_prompt if self.waiting else 0
        target = (s.itl_target_s - s.margin_z * s.spread_s) / self.shared_slowdown
        got = s.published.largest_chunk(target, rows, context, start, s.max_prefill_tokens, s.page_size)
        return min(s.max_prefill_tokens, max(MIN_PAGES * s.page_size, got))

    def run_tokens_done(self, now: float) -> int:
        """Prompt tokens the steps of a prompt run in flight have finished by `now` (0: no run)."""
        if not self.run_ends:
            return 0
        steps = bisect_right(self.run_ends, now)
        if self.run_last:
            # the last chunk counts at the event that ends the run, as a step of its own would
            steps = min(steps, len(self.run_ends) - 1)
        return steps * self.span_chunks[0][1]

    def load(self, now: float) -> Load:
        done = self.run_tokens_done(now) if self.run_ends else 0
        stamp = (self.version, self.added, self.draining, done, self.decodes_accepted)
        last = self._last_load
        if last is not None and last[0] == stamp:
            return last[1]
        s = self.spec
        pub, pub_map, rate = s.published, s.published_map, s.prefill_rate
        if self.shared_slowdown != 1.0:
            # its live model on a shared GPU: every coefficient as much slower as its steps run there
            k = self.shared_slowdown
            pub = StepCost(*(getattr(pub, f) * k for f in StepCost.__dataclass_fields__))
            pub_map, rate = pub.as_map(), rate / k
        rows = len(self.rows)
        ctx = self.sum_prompt + rows * self.steps - self.sum_join  # context(), in line
        chunk = self.chunk_budget(rows, ctx)
        total = s.kv_tokens // s.page_size
        # positional (keywords cost its __init__ ~2x: a snapshot is built for about every other request), each
        # value named by the field it fills
        load = Load(
            self.role,  # role
            self.name,  # pod
            self.queued_tokens - done,  # queued_prefill_tokens
            rows + len(self.joining),  # running_requests
            len(self.waiting),  # waiting_requests
            max(0, total - math.ceil(self.reserved_kv / s.page_size)),  # free_pages
            total,  # total_pages
            s.page_size,  # page_size
            True,  # ready
            self.draining,  # draining
            s.max_running,  # max_running
            rate,  # prefill_tokens_per_s
            chunk if self.role != "prefill" else 0,  # prefill_chunk_tokens
            rate,  # prefill_step_tokens_per_s
            pub.overhead_s(max(rows, 1), ctx),  # decode_step_s
            s.itl_target_s,  # itl_target_s
            rows + len(self.waiting) + len(self.joining),  # live_requests
            s.kv_tokens,  # max_request_tokens
            0,  # kv_reserve_output_tokens
            pub_map,  # step_coefficients
            chunk,  # step_chunk_tokens
            rows,  # decode_rows
            ctx,  # decode_context
            _NO_CLASSES,  # queued_ahead_tokens
            0,  # step_overruns
            0,  # step_stalls
            self.prompt_tokens_accepted if self.publishes_accepted else 0,  # prompt_tokens_accepted
            self.decodes_accepted if self.publishes_accepted else 0,  # decodes_accepted
        )
        # what parsing its step_coefficients gives, shared by every snapshot (set as an attribute: a cached_property
        # takes it so, and reading __dict__ would turn the snapshot's compact attribute values into a dict)
        load.step_cost = pub
        self._last_load = (stamp, load)
        return load

    def idle(self) -> bool:
        return not self.waiting and not self.rows and not self.joining and self.busy_until < 0

    # ---- work arriving ------------------------------------------------------------------------------------
    def add(self, job: Job, now: float) -> bool:
        """Queues `job`; True when the worker was idle (the caller schedules its wake-up at `now`)."""
        self.added += 1
        self.reserved_kv += job.kv
        job.seen_at = now
        if job.todo > 0:
            self.waiting.append(job)
            self.queued_tokens += job.todo
            self.prompt_tokens_accepted += job.prompt
        else:
            self.joining.append(job)  # joins the batch at the next step boundary
        return self.busy_until < 0

    def next_boundary(self, now: float) -> float:
        """When its step in flight at `now` ends (its loop's next turn): `now` when idle."""
        if self.busy_until < 0:
            return now
        if self.run_ends:
            return self.run_ends[min(bisect_right(self.run_ends, now), len(self.run_ends) - 1)]
        if self.span_steps > 1 and not self.span_shared:
            done = int((now - self.span_start) / self.span_step_s) + 1
            return min(self.busy_until, self.span_start + done * self.span_step_s)
        return self.busy_until

    def cut_span(self, now: float, job: Job | None = None) -> float | None:
        """A decode stretch in flight ends at the next step boundary after `now` (new work waits for it), and so
        does a prompt run unless the new `job` only queues behind its prompt (None: something else changed);
        returns the new wake-up time, or None when nothing needs to change."""
        if self.busy_until < 0 or self.span_steps <= 1:
            return None
        if self.run_ends:
            finished = bisect_right(self.run_ends, now)
            if job is not None and job.todo > 0:
                # it waits behind the prompt the run's steps fill, and shares its last chunk's step if that has
                # not started yet: the run then ends before it
                # (launch ahead: the step after the one in flight was planned already, so the last chunk's step
                # must start two steps on at least)
                if not self.run_last or finished >= self.span_steps - 1 - self.spec.launch_ahead:
                    return None
                done = self.span_steps - 1
            else:
                done = finished + 1
                if done >= self.span_steps:
                    return None
            self.span_steps = done
            self.run_last = 0
            del self.run_steps_s[done:], self.run_ends[done:]
            self.busy_until = self.run_ends[-1]
            self.version += 1
            return self.busy_until
        if self.span_chunks:
            return None
        done = int((now - self.span_start) / self.span_step_s) + 1
        if done >= self.span_steps:
            return None
        self.span_steps = done
        self.busy_until = self.span_start + done * self.span_step_s
        self.version += 1
        return self.busy_until

    def _join(self, job: Job) -> None:
        job.join_step = self.steps
        job.bad_at_join = self.bad_steps
        heapq.heappush(self.rows, (self.steps + job.output, self._next_seq(), job))
        self.sum_prompt += job.prompt
        self.sum_join += self.steps

    def _next_seq(self) -> int:
        self._step_seq += 1
        return self._step_seq

    # ---- the step loop ------------------------------------------------------------------------------------
    def wake(self, now: float) -> float | None:
        """Ends the event in flight at `now` and starts the next; returns its end (None: idle)."""
        if self.busy_until >= 0:
            self.version += 1  # its state moves on (also when it goes idle: no next event bumps it then)
            self._finish_span(now)
        else:
            self.planned_at = math.inf  # an idle engine plans at once
        end = self._start(now)
        if end is None and self.device is not None:
            self.device.release(self, now)  # nothing queued: the GPU goes to whoever waits
        return end

    def retime(self, device_end: float) -> float:
        """Its step's device part now ends at `device_end` (another step started on its GPU); the new wake-up."""
        self.busy_until = device_end + self.spec.host_s
        self.version += 1
        return self.busy_until

    def _finish_span(self, now: float) -> None:
        if self.run_ends:
            self._finish_run(now)
            return
        k, s = self.span_steps, self.span_step_s
        if self.span_shared:
            s = now - self.span_start  # one step, as long as sharing its GPU made it
            self.shared_slowdown += SHARED_SLOWDOWN_GAIN * (s / self.span_step_s - self.shared_slowdown)
        self.planned_at = now - s  # its last step's start
        n = len(self.rows)
        self.busy_s += k * s
        if self.span_chunks and self.spec.itl_target_s <= 0:
            # prefill-first: the rows decoded nothing this step; their next gap is this much longer
            self.held_gap_s += s
            k = 0
        elif n:
            first = s + self.held_gap_s
            if k > 1 and first == s:
                self.record_itl(s, n * k)  # the same histogram bin: one record (integer counts, the same sums)
            else:
                self.record_itl(first, n)
                if k > 1:
                    self.record_itl(s, n * (k - 1))
            target = self.itl_slo_s
            self.bad_steps += (first > target) + (k - 1) * (s > target)
            self.held_gap_s = 0.0
        self.steps += k
        self.busy_until = -1.0
        while self.rows and self.rows[0][0] <= self.steps:
            _, _, job = heapq.heappop(self.rows)
            self.sum_prompt -= job.prompt
            self.sum_join -= job.join_step
            self.reserved_kv -= job.kv
            slow = (self.bad_steps - job.bad_at_join) / max(job.output, 1)
            self.on_finish(self, job, now, slow)
        for job, n_tok in self.span_chunks:
            job.done_prompt += n_tok
            job.todo -= n_tok
            self.queued_tokens -= n_tok
            self.prefill_tokens_done += n_tok
            if job.todo <= 0:
                self._prompt_done(job, now)
        self.span_chunks = []

    def _prompt_done(self, job: Job, now: float) -> None:
        """`job`'s last chunk is done at `now`: its first token."""
        if self.waiting and self.waiting[0] is job:
            self.waiting.popleft()
        else:
            self.waiting.remove(job)
        if job.output > 0:
            # its first token came with its last chunk; the rest decode here
            job.output -= 1
            self.on_first_token(self, job, now)
            if job.output > 0:
                self._join(job)
            else:
                self.reserved_kv -= job.kv
                self.on_finish(self, job, now, 0.0)
        else:
            self.reserved_kv -= job.kv
            self.on_first_token(self, job, now)

    def _finish_run(self, now: float) -> None:
        """The steps of a prompt run, one by one as _finish_span takes a prompt step (no row decodes, none
        finishes, its prompt only at a last step carrying its last chunk)."""
        prefill_first = self.spec.itl_target_s <= 0
        self.planned_at = self.run_ends[-1] - self.run_steps_s[-1]
        for s in self.run_steps_s:
            self.busy_s += s
            if prefill_first:
                self.held_gap_s += s
        k = len(self.run_steps_s)
        if not prefill_first:
            self.steps += k
        job, n_tok = self.span_chunks[0]
        last = self.run_last
        full = k - 1 if last else k
        job.done_prompt += full * n_tok
        job.todo -= full * n_tok
        self.queued_tokens -= full * n_tok
        self.prefill_tokens_done += full * n_tok
        self.busy_until = -1.0
        self.span_chunks = []
        self.run_steps_s = []
        self.run_ends = []
        self.run_last = 0
        if last:
            job.done_prompt += last
            job.todo -= last
            self.queued_tokens -= last
            self.prefill_tokens_done += last
            self._prompt_done(job, now)

    def _start(self, now: float) -> float | None:
        s = self.spec
        # launch ahead: this step was planned when the one that just ended started; what came later waits a step
        planned = self.planned_at if s.launch_ahead else math.inf
        if planned < math.inf and not self.rows and not self._any_seen_by(planned):
            planned = math.inf  # nothing was known to run then: the engine launched no step, and plans this one now
        if self.joining:
            self._take_joining(now, planned)
        cost = s.cost
        chunks: list[tuple[Job, int]] = []
        n = len(self.rows)
        ctx = self.sum_prompt + n * self.steps - self.sum_join  # context(), in line: taking chunks changes neither
        if self.waiting and n < s.max_running:
            budget, attention = self.chunk_budget(n, ctx), 0.0
            rows_free = s.max_running - n
            for job in self.waiting:
                if budget <= 0 or rows_free <= 0 or job.seen_at > planned:
                    break
                take = min(budget, job.todo)
                chunks.append((job, take))
                attention += chunk_attention(job.done_prompt, take)
                budget -= take
                if take == job.todo and job.output > 0:
                    rows_free -= 1
        device = self.device if self.device is not None and len(self.device.members) > 1 else None
        shared = device is not None
        if not shared and n == 0 and len(chunks) == 1:
            job, chunk = chunks[0]
            if chunk < job.todo - chunk or (chunk < job.todo and len(self.waiting) == 1):
                return self._start_run(now, job, chunk)
        if chunks:
            tokens = sum(t for _, t in chunks)
            if s.itl_target_s <= 0:
                n, ctx = 0, 0  # prefill-first: a prompt step decodes nothing
            step = cost.step_s(tokens, n, ctx, attention)
            if n and s.chunk_noise:
                self._noise_at = (self._noise_at + NOISE_STRIDE) % len(s.chunk_noise)
                step *= max(0.0, 1.0 + s.chunk_noise[self._noise_at])
            step += s.host_s
            self.span_chunks, self.span_steps = chunks, 1
        elif n:
            # one step at a time while work waits to be planned in (launch ahead) or shares the GPU
            later = bool(self.joining) or (bool(self.waiting) and self.waiting[0].seen_at > planned)
            k = 1 if shared or later else max(1, self.rows[0][0] - self.steps)
            step = cost.overhead_s(n, ctx + n * (k // 2)) + s.host_s
            self.span_steps = k
        else:
            return None
        self.span_start, self.span_step_s, self.span_shared = now, step, shared
        if device is not None:
            device_s = step - s.host_s
            weight = s.share_weight(device_s, bool(chunks))
            self.busy_until = device.start(self, device_s, now, weight) + s.host_s
        else:
            self.busy_until = now + step * self.span_steps
        self.version += 1
        return self.busy_until

    def _any_seen_by(self, planned: float) -> bool:
        """Whether any queued work had reached the engine by `planned` (the waiting queue is in arrival order)."""
        if self.waiting and self.waiting[0].seen_at <= planned:
            return True
        return any(job.seen_at <= planned for job in self.joining)

    def _take_joining(self, now: float, planned: float) -> None:
        """Rows whose KV arrived from a peer: the engine's loop turn takes each in (Scheduler.settle_transfers)
        and sends its first token then, at the step boundary after it landed; it decodes from the next step planned
        after that (`planned`: launch ahead, the one after this; unless nothing else runs)."""
        keep = []
        for job in self.joining:
            if job.first_token < 0:
                job.first_token = now
                self.on_first_token(self, job, now)
            if job.seen_at <= planned:
                self._join(job)
            else:
                keep.append(job)
        self.joining = keep

    def _start_run(self, now: float, job: Job, chunk: int) -> float:
        """Full chunks of `job` while more than a chunk of it stays for the step after (its last chunk, and what
        the budget left then takes of the next prompt, is a step of its own unless it waits alone); the times as
        step by step."""
        s = self.spec
        cost = s.cost
        steps = (job.todo - 1) // chunk  # the steps with more than `chunk` of it still to do before them
        last = job.todo - steps * chunk if len(self.waiting) == 1 else 0
        times, ends = [], []
        t, start = now, job.done_prompt
        overhead = cost.overhead_s(0, 0)  # nothing decodes beside a run
        for i in range(steps + (last > 0)):
            take = chunk if i < steps else last
            step = cost.chunk_step_s(overhead, take, 0.0 + chunk_attention(start, take)) + s.host_s
            t = t + step
            times.append(step)
            ends.append(t)
            start += take
        self.span_chunks = [(job, chunk)]
        self.run_steps_s, self.run_ends, self.run_last = times, ends, last
        steps = len(times)
        self.span_steps = steps
        self.span_start, self.span_step_s = now, times[0]
        self.busy_until = t
        self.version += 1
        return t
