"""The engine process of a worker: model, KV pool, scheduler, NIXL agent and prefix publisher in one loop.

The control plane (HTTP) talks to it over a pipe (common/serving/channel.py). Each loop turn drains
commands, runs one scheduler step when there is work, advances transfers, and reports events in one
message per turn. What a worker does with it comes from its roles (``EngineRole``: the decode role in
decode_worker/engine.py, the prefill role in prefill_worker/engine.py; a mixed worker's engine has both).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol

from common.config import WorkerConfig
from common.engine.runner import ModelRunner
from common.engine.threads import apply_engine_threads
from common.engine.tp_ranks import TPRankLost
from common.kv.integrity import IdleLedgerCheck
from common.log import setup_logging
from common.observability.timeline import Stamps
from common.prefix.hashing import chained_block_hashes
from common.prefix.publisher import PrefixIndexPublisher
from common.protocol import LoadSnapshot, SamplingParams, TokenLine
from common.sched.kv_connector import combined
from common.sched.request import Req, ReqState
from common.sched.scheduler import DuplicateRequest, RequestRejected, Scheduler, StepEvent
from common.sched.warm_up import warm_up
from common.serving import tp_follower
from common.serving.channel import recv, send
from common.serving.messages import (
    Abort,
    AgentInfo,
    Batch,
    Call,
    Event,
    KVIntegrity,
    Load,
    Ready,
    Reply,
    Steps,
    Stop,
    Stopping,
    Tokens,
    Wire,
)
from common.serving.prefill_rate import PrefillRate
from common.settings_registry import DEBUG_CHECKSUMS, TORCH_THREADS
from common.transfer.agent import KVTransferAgent

log = logging.getLogger("kvferry.engine")

LOAD_INTERVAL_S = 0.1
# Idle, the load changes only with a command (which wakes the loop), so it goes out this seldom: the loop
# blocks on the command pipe in between (an idle worker costs next to no CPU).
IDLE_LOAD_INTERVAL_S = 1.0
# A turn whose only work waits on transfers (a KV notice, writes in flight): NIXL has no descriptor to block
# on, so the loop polls this often, waking at once for a command; a zero wait spun a core a peer needed.
TRANSFER_POLL_S = 0.001
DECODE_STEP_SMOOTHING = 0.1  # weight of the newest decode step in the published step time
MAX_TIMELINES = 16384  # stage stamps kept for requests in flight; beyond it the oldest go (a leak guard)
# A turn with nothing to do but wait for staging space (prefill_worker/engine.py, `waits_only`) waits this long for
# a command first, instead of polling its writes again at once: the space comes back only as they complete.
STAGING_WAIT_S = 0.0005
COMPILE_POLL_S = 0.002  # a turn whose only work is a grammar compiling off the loop waits this long for a command
IDLE_TRIM_S = 1.0  # idle this long: hand the allocator's free memory back to the OS (once per idle spell)


# command type -> what runs it (returns the reply's result). Every call is answered in the loop turn that handles
# it: a handler queues what takes longer and reports it by events, so a caller never waits on admission.
Handlers = dict[type, Callable[[Any], Wire | None]]


class Refused(Exception):
    """A command the engine will not run; the caller's ``EngineError`` carries ``code``."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def stage_role(req: Req) -> str:
    """The role a request's stage stamps are named after: what this engine does for it (a mixed worker
    prefills some requests for peers and decodes others)."""
    return "prefill" if req.prefill_only else "decode"


def _malloc_trim() -> None:
    """glibc keeps freed heap memory for reuse; a CPU engine serving steps of ever-changing shapes ends up
    holding hundreds of MB of it (soak: decode RSS +372 MB over 1,500 requests, +112 MB with forced mmap,
    which halved throughput). Trimming while idle returns it without slowing the steps."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class EngineRole(Protocol):
    """One job of an engine over its host's scheduler, pool and agent; built as ``role_cls(host)``, before the
    scheduler (which it may use only once built). Each role is also a `KVConnector` subclass: what the scheduler
    asks about its requests' KV transfer (common/sched/kv_connector.py)."""

    handlers: Handlers  # this role's commands (disjoint from every other role's)

    def has_work(self) -> bool: ...

    def holds(self, req_id: str) -> bool:
        """Whether this role is the one to abort the request (the first role holding it does)."""
        ...

    def abort(self, req_id: str, reason: str, error: str | None) -> None: ...

    def waits_only(self) -> bool:
        """Whether all of this role's work waits on something no sooner loop turn brings (staging space)."""
        ...

    def hands_on_stamps(self, req_id: str) -> bool:
        """Whether this request's stage stamps leave with its KV (a prefill for a peer: in the KV notice and
        the done event) rather than with its first-token event, which drops them when the request finishes."""
        ...

    def tick(self) -> None:
        """Advances transfers and deadlines; called every loop turn."""
        ...


class EngineHost:
    def __init__(
        self, cfg: WorkerConfig, conn: Connection, roles: Sequence[Callable[[EngineHost], EngineRole]]
    ) -> None:
        self.cfg = cfg
        self.conn = conn
        self.role = cfg.role
        agent_name = f"{self.role}-{cfg.pod_name}"
        cfg.runner.tp_agent_name = agent_name  # tensor-parallel followers with agents of their own derive theirs
        cfg.runner.tp_follower_main = tp_follower.__name__  # followers that can run those agents
        self.runner = ModelRunner(cfg.runner)
        self.page_size = cfg.runner.page_size
        remote_ranks = None
        if self.runner.per_rank_agents:
            from common.transfer.rank_agents import collect_rank_agents

            remote_ranks = collect_rank_agents(self.runner.tp.store, self.runner.tp.size)
        self.agent = KVTransferAgent(
            agent_name,
            self.runner.pool,
            model_id=cfg.runner.model,
            rank_pools=self.runner.kv_rank_pools(),
            remote_ranks=remote_ranks,
            staging_bytes=int(cfg.transfer_staging_mb * (1 << 20)),
            progress_delay_us=None if cfg.nixl_progress_delay_us < 0 else cfg.nixl_progress_delay_us,
        )
        # The roles (built over the runner and the agent) answer the scheduler's KV-transfer asks through
        # their connectors (common/sched/kv_connector.py). Overlap on the GPU (the CPU schedules step N+1
        # while step N runs); off on the CPU and under tensor parallelism (see common/sched/scheduler.py).
        self.roles = [make(self) for make in roles]
        if cfg.warm_up == "on" or (cfg.warm_up == "auto" and self.runner.device.type == "cuda"):
            with self.runner.start_phases.timed("warm_up"):
                warm_up(self.runner, cfg.sched)
        self.scheduler = Scheduler(self.runner, cfg.sched, connector=combined(self.roles))
        self.kv_verified: dict[str, bool] = {}  # arrived KV whose checksums matched: said in the first-token event
        tiered = self.scheduler.snapshot().host_pages_total > 0
        self.publisher = PrefixIndexPublisher(
            cfg.redis_url,
            cfg.runner.model,
            cfg.pod_name,
            resync=self._cached_hashes,
            resync_host=(lambda: self._cached_hashes("host")) if tiered else None,
            access=cfg.redis_access,
        )
        self.outbox: list[Event] = []
        self.stopping = False
        self._last_load = 0.0
        self.loop_turns = 0  # loop turns so far (published: an idle engine's stays put)
        self.prefill_rate = PrefillRate()
        self.debug_checksums = DEBUG_CHECKSUMS.read()
        # Observability (common/serving/engine_metrics.py): per-request stage stamps, sent with the request's
        # first-token event; requests queued for a prefill batch, whose admission the step loop stamps; and
        # the decode steps' [seconds, batch size] since the last report.
        self.stamps: dict[str, Stamps] = {}
        self._queued: dict[str, Req] = {}
        self._steps: list[float] = []
        self.step_started = 0.0  # time.time() when the current scheduler step began
        self.ledger_check = IdleLedgerCheck()
        self.decode_step_s = 0.0  # smoothed decode-only step time, published for the router's ITL model
        # This role's commands, by type; role classes add theirs.
        self.handlers: Handlers = {Stop: self._stop, Abort: self._abort}
        for role in self.roles:
            self.handlers.update(role.handlers)

    def hands_on_stamps(self, req_id: str) -> bool:
        return any(role.hands_on_stamps(req_id) for role in self.roles)

    # ---- helpers for the roles ------------------------------------------------------------------
    def make_req(
        self,
        req_id: str,
        token_ids: list[int],
        sampling: SamplingParams,
        received: float | None,
        prefill_only: bool = False,
    ) -> Req:
        req = Req(req_id=req_id, prompt_ids=list(token_ids), sampling=sampling)
        req.prefill_only = prefill_only
        req.block_hashes = chained_block_hashes(req.prompt_ids, self.page_size)
        if len(self.stamps) >= MAX_TIMELINES:
            del self.stamps[next(iter(self.stamps))]
        stage = stage_role(req)
        stamps = self.stamps[req.req_id] = {f"{stage}_engine_received": time.time()}
        if isinstance(received, int | float):  # the control plane's stamp
            stamps[f"{stage}_received"] = float(received)
        return req

    def enqueue(self, req: Req) -> None:
        """Queues a request for local prefill (the step loop stamps its admission)."""
        self.scheduler.add(req)
        self._queued[req.req_id] = req

    def mark(self, req_id: str, stage: str, t: float | None = None) -> None:
        """Stamps a stage of a request in flight (one whose stamps were dropped is left alone)."""
        stamps = self.stamps.get(req_id)
        if stamps is not None:
            stamps[stage] = time.time() if t is None else t

    def emit(self, event: Tokens) -> None:
        if event.finish_reason and not self.hands_on_stamps(event.req_id):
            self.stamps.pop(event.req_id, None)
        self.outbox.append(event)

    def emit_step_events(self, events: list[StepEvent], kv_verified: bool | None = None) -> None:
        for e in events:
            r = e.req
            first = len(r.output_ids) == len(e.tokens)  # the request's first tokens
            timeline = None
            if first and not self.hands_on_stamps(r.req_id):
                timeline = self.stamps.pop(r.req_id, None)
                if timeline is not None:
                    timeline["first_token"] = time.time()
            line = TokenLine(
                token_ids=e.tokens,
                logprobs=e.logprobs or None,
                prompt_tokens=r.prompt_len if first else 0,
                cached_tokens=r.prefix_hit_len if first else 0,
                timeline=timeline,
                finish_reason=r.finish_reason if e.finished else None,  # type: ignore[arg-type]
                error=(r.error or None) if e.finished else None,
                kv_verified=kv_verified,
            )
            self.emit(Tokens(r.req_id, line))

    # ---- the loop --------------------------------------------------------------------------------
    def agent_info(self) -> AgentInfo:
        return AgentInfo(
            agent_name=self.agent.name,
            instance_id=self.agent.instance_id,
            agent_metadata_b64=self.agent.metadata_b64(),
            pool_info_b64=self.agent.pool_info_b64(),
            layout=self.agent.layout,
        )

    def run(self) -> None:
        self.publisher.start()
        send(self.conn, Ready(self.agent_info(), self.cfg.pod_name, self.runner.start_phases.seconds))
        last_busy, trimmed = time.monotonic(), True
        while not self.stopping:
            self.loop_turns += 1
            busy = self.has_work()
            now = time.monotonic()
            if busy:
                last_busy, trimmed = now, False
            elif not trimmed and now - last_busy >= IDLE_TRIM_S:
                _malloc_trim()
                trimmed = True
            timeout = self._wait_s(busy, now, last_busy, trimmed)
            while self.conn.poll(timeout):
                self.handle(recv(self.conn))
                timeout = 0.0
            self.tick()
            self.settle()
            self.check_ledger()
            if self.outbox:
                # What the tick produced (a first token whose KV just landed) goes out now, not after the
                # next model step: measured on the CPU, waiting for it added one decode step to TTFT.
                self.flush()
            if self.scheduler.has_work():
                try:
                    self.step_started = started = time.time()
                    events = self.scheduler.step()
                    self._observe_step(started, events)
                    self.emit_step_events(events)
                except TPRankLost:
                    # This worker cannot compute any more: fail what is in flight, then exit, so /health turns
                    # 503 and the pod is restarted (a live process answering only errors would keep traffic).
                    log.exception("a tensor-parallel rank is gone; the engine stops")
                    send(self.conn, Stopping("a tensor-parallel rank of this worker exited"))
                    self.fail_all("a tensor-parallel rank of this worker exited")
                    self.flush()
                    raise
                except Exception:
                    # A step that raised left its batch in an unknown state: fail the requests in flight (their
                    # pages come back) and keep serving, rather than take the whole worker down.
                    log.exception("scheduler step failed; aborting the requests in flight")
                    self.fail_all("internal error in the engine step")
            for rid, error in self.scheduler.take_compile_failures():
                self.abort(rid, "error", error)  # through its role: a prefill for a peer ends its session too
            for tier, hashes in self.scheduler.take_index_events():
                if tier is None:
                    self.publisher.removed(hashes)
                else:
                    self.publisher.stored(hashes, tier)  # moved to the host tier, or loaded back
            now = time.monotonic()
            if now - self._last_load >= self._load_interval(last_busy):
                self._last_load = now
                self.outbox.append(Load(self.load()))
                if self._steps:
                    self.outbox.append(Steps(self._steps))
                    self._steps = []
            self.flush()
        self.shutdown()

    def _load_interval(self, last_busy: float) -> float:
        """Busy, or the first snapshot after work ended (the one that shows every page back): every
        LOAD_INTERVAL_S; idle after that: every IDLE_LOAD_INTERVAL_S."""
        return LOAD_INTERVAL_S if self._last_load <= last_busy else IDLE_LOAD_INTERVAL_S

    def _wait_s(self, busy: bool, now: float, last_busy: float, trimmed: bool) -> float:
        """How long this turn waits for a command before it moves on: not at all while the scheduler has
        steps to run; briefly while only transfers are under way; idle, until the next thing with a time
        (the load snapshot, the allocator trim), blocking on the pipe meanwhile (no polling)."""
        if self.scheduler.has_work() and not self.scheduler.compiling_only():
            return 0.0
        if busy and not any(r.has_work() for r in self.roles):
            return COMPILE_POLL_S  # only grammars compiling (on a worker thread): no spinning beside them
        if busy:
            waiting = [r for r in self.roles if r.has_work()]
            return STAGING_WAIT_S if all(r.waits_only() for r in waiting) else TRANSFER_POLL_S
        due = self._last_load + self._load_interval(last_busy)
        if not trimmed:
            due = min(due, last_busy + IDLE_TRIM_S)
        return max(0.0, due - now)

    def check_ledger(self) -> None:
        """While idle, every page must be free or cached exactly once (common/kv/integrity.py)."""
        problems = self.ledger_check(not self.has_work(), self.scheduler.ledger_violations)
        if problems:
            self.outbox.append(KVIntegrity(len(problems)))

    def _observe_step(self, started: float, events: list[StepEvent]) -> None:
        """Per step, never per token: a decode-only step's time and batch size; admissions of queued requests."""
        if (
            events
            and self.scheduler.last_step_kind() == "decode"  # not a mixed step that finished no prompt
            and all(len(e.req.output_ids) > len(e.tokens) for e in events)
        ):
            seconds = time.time() - started
            self._steps += (seconds, len(events))
            prev = self.decode_step_s
            self.decode_step_s = seconds if prev <= 0 else prev + DECODE_STEP_SMOOTHING * (seconds - prev)
        self.note_admissions()

    def note_admissions(self) -> None:
        """Stamps the queued requests the current step took in (also callable from the step's hooks)."""
        if self._queued:
            for rid, req in list(self._queued.items()):
                if req.state is not ReqState.WAITING:  # taken into this step (possibly finished in it)
                    del self._queued[rid]
                    self.mark(rid, f"{stage_role(req)}_admitted", self.step_started)

    def flush(self) -> None:
        if not self.outbox:
            return
        batch, self.outbox = self.outbox, []
        send(self.conn, Batch(batch))

    def handle(self, msg: Wire) -> None:
        """Runs a command (a ``Call``'s is answered with a ``Reply``; a cast's outcome is not reported)."""
        rpc, cmd = (msg.rpc, msg.cmd) if isinstance(msg, Call) else (None, msg)
        error: tuple[str, str] | None = None
        result = None
        try:
            handler = self.handlers.get(type(cmd))
            if handler is None:
                raise Refused(f"{type(cmd).__name__} is no command of a {self.role} engine", "invalid_request")
            result = handler(cmd)
        except Refused as e:
            error = str(e), e.code
        except DuplicateRequest as e:
            error = str(e), "duplicate_request"
        except RequestRejected as e:
            error = str(e), "invalid_request"
        except Exception as e:  # a bad command must not take the engine down
            log.exception("engine command failed", extra={"op": type(cmd).__name__})
            error = f"{type(e).__name__}: {e}", "engine_error"
        if rpc is not None:
            self.outbox.append(Reply(rpc, result) if error is None else Reply(rpc, error=error[0], code=error[1]))

    def _stop(self, cmd: Stop) -> None:
        self.stopping = True

    def _abort(self, cmd: Abort) -> None:
        self.abort(cmd.req_id, cmd.reason, cmd.error)

    def shutdown(self) -> None:
        self.publisher.stop(deregister=True)
        self.flush()
        self.runner.close()

    def _cached_hashes(self, tier: str = "device") -> list[int]:
        # Runs on the publisher's thread while the loop may change the tree: retry a torn walk.
        for _ in range(5):
            try:
                return self.scheduler.cached_block_hashes(tier)
            except RuntimeError:
                time.sleep(0.001)
        return []

    def load(self) -> LoadSnapshot:
        snap = self.scheduler.snapshot()
        queued = snap.queued_prefill_tokens
        rate = self.prefill_rate.observe(time.monotonic(), snap.prefill_tokens_launched, queued > 0)
        return LoadSnapshot(
            role=self.role,  # type: ignore[arg-type]
            pod=self.cfg.pod_name,
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
            loop_turns=self.loop_turns,
            host_pages_cached=snap.host_pages_cached,
            host_pages_total=snap.host_pages_total,
            host_pages_saved=snap.host_pages_saved,
            host_pages_loaded=snap.host_pages_loaded,
        )

    def fail_all(self, error: str) -> None:
        for rid in self.scheduler.live_request_ids():
            self.abort(rid, "error", error)

    def settle(self) -> None:
        """Transfers that ended this turn: held pages go back, requests whose KV arrived join the running
        batch and their first tokens go out now, not after the next model step."""
        for event in self.scheduler.settle_transfers():
            self.emit_step_events([event], kv_verified=self.kv_verified.pop(event.req.req_id, None))

    # ---- what the roles add up to -------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or any(role.has_work() for role in self.roles)

    def abort(self, req_id: str, reason: str, error: str | None) -> None:
        for role in self.roles:
            if role.holds(req_id):
                role.abort(req_id, reason, error)
                return

    def tick(self) -> None:
        for role in self.roles:
            role.tick()


def engine_main(roles: Sequence[type], cfg: WorkerConfig, conn: Connection) -> None:
    """Entry point of the engine process (multiprocessing spawn target)."""
    setup_logging()
    # oneDNN keeps up to 1024 compiled primitives, one per GEMM shape; a CPU engine sees a new shape at
    # almost every step, and the cache held ~150 MB more after a 1,500-request soak (+113 MB instead of
    # +260 MB at 64 entries, same req/s; bench/engine_cpu.py 230 vs 231 tok/s). Read at its first use,
    # inherited by tensor-parallel ranks; an operator's own setting wins.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    threads = apply_engine_threads(cfg.runner.device, TORCH_THREADS.read())
    log.info("engine threads", extra={"torch_threads": threads, "device": cfg.runner.device})
    try:
        EngineHost(cfg, conn, roles).run()
    except Exception:
        log.exception("engine process failed")
        raise
