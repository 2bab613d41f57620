"""The engine process of a worker: model, KV pool, scheduler, NIXL agent and prefix publisher, held by one
``EngineHost``; its loop (engine_loop.py) runs them, its load report (load_report.py) says how busy they are.

The control plane (HTTP) talks to it over a pipe (common/worker/channel.py), in commands run by their type
(commands.py). What a worker does with it comes from its roles (``EngineRole``: the decode role in
decode_worker/engine.py, the prefill role in prefill_worker/engine.py; a mixed worker's engine has both).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

from common.config import WorkerConfig
from common.engine.runner import ModelRunner
from common.gc_pauses import GcPauses, freeze_startup_objects
from common.kv.integrity import IdleLedgerCheck
from common.observability.stack_samples import StackSamples
from common.observability.timeline import Stamps
from common.prefix.hashing import chained_block_hashes
from common.prefix.publisher import PrefixIndexPublisher
from common.protocol import PROMPT_LOGPROBS_LINE_BYTES, SamplingParams, TokenLine
from common.sched.kv_connector import combined
from common.sched.request import Req, ReqState
from common.sched.scheduler import Scheduler, StepEvent
from common.sched.warm_up import warm_up
from common.settings_registry import DEBUG_CHECKSUMS, STACK_SAMPLES
from common.transfer.agent import KVTransferAgent
from common.worker import tp_follower
from common.worker.channel import send
from common.worker.commands import EngineRole, Handlers, run_command
from common.worker.load_report import LoadReport
from common.worker.messages import Abort, AgentInfo, Batch, Event, KVIntegrity, Stop, Tokens, Wire

MAX_TIMELINES = 16384  # stage stamps kept for requests in flight; beyond it the oldest go (a leak guard)


def stage_role(req: Req) -> str:
    """The role a request's stage stamps are named after: what this engine does for it (a mixed worker
    prefills some requests for peers and decodes others)."""
    return "prefill" if req.prefill_only else "decode"


class EngineHost:
    def __init__(
        self,
        cfg: WorkerConfig,
        conn: Connection,
        roles: Sequence[Callable[[EngineHost], EngineRole]],
        process_s: float | None = None,
    ) -> None:
        self.cfg = cfg
        self.conn = conn
        self.role = cfg.role
        agent_name = f"{self.role}-{cfg.pod_name}"
        cfg.runner.tp_agent_name = agent_name  # tensor-parallel followers with agents of their own derive theirs
        cfg.runner.tp_follower_main = tp_follower.__name__  # followers that can run those agents
        self.runner = ModelRunner(cfg.runner)
        if process_s is not None:
            self.runner.start_phases.record("process", process_s)
        self.page_size = cfg.runner.page_size
        remote_ranks = None
        if self.runner.per_rank_agents:
            from common.transfer.rank_agents import collect_rank_agents

            remote_ranks = collect_rank_agents(self.runner.tp.store, self.runner.tp.size)
        with self.runner.start_phases.timed("transfer"):
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
                warmed = warm_up(self.runner, cfg.sched)
        else:
            warmed = None
        # The host KV tier is page-locked in the loop's idle turns (EngineLoop.turn: lock_host_tier), after the start.
        self.scheduler = Scheduler(self.runner, cfg.sched, connector=combined(self.roles), defer_host_lock=True)
        if warmed is not None:
            self.scheduler.seed_prefill_speed(warmed.prefill_tokens_per_s)
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
        self.loop_turns = 0  # loop turns so far (published: an idle engine's stays put)
        # Everything built so far (weights, modules, graphs) lives as long as the engine: out of the collector's
        # walks, so a full collection costs the objects made since, not the model (common/gc_pauses.py).
        freeze_startup_objects()
        self.report = LoadReport(
            self.scheduler, self.role, cfg.pod_name, self.page_size, gc=GcPauses().install(), device=self.runner.device
        )
        self.debug_checksums = DEBUG_CHECKSUMS.read()
        samples = STACK_SAMPLES.read()
        self.stack_samples = StackSamples(samples).start() if samples else None
        # Observability (common/worker/engine_metrics.py): per-request stage stamps, sent with the request's
        # first-token event; requests queued for a prefill batch, whose admission the step loop stamps.
        self.stamps: dict[str, Stamps] = {}
        self._queued: dict[str, Req] = {}
        self.step_started = 0.0  # time.time() when the current scheduler step began
        self.ledger_check = IdleLedgerCheck()
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
            scored = r.prompt_logprobs if first else None
            if scored is not None:
                *ahead, scored = scored.pieces(PROMPT_LOGPROBS_LINE_BYTES)
                for piece in ahead:
                    self.emit(Tokens(r.req_id, TokenLine(prompt_logprobs=piece)))
            line = TokenLine(
                token_ids=e.tokens,
                logprobs=e.logprobs or None,
                prompt_logprobs=scored,
                prompt_tokens=r.prompt_len if first else 0,
                cached_tokens=r.prefix_hit_len if first else 0,
                timeline=timeline,
                finish_reason=r.finish_reason if e.finished else None,  # type: ignore[arg-type]
                error=(r.error or None) if e.finished else None,
                kv_verified=kv_verified,
                invalid_request=r.request_fault and e.finished,
            )
            self.emit(Tokens(r.req_id, line))

    def agent_info(self) -> AgentInfo:
        return AgentInfo(
            agent_name=self.agent.name,
            instance_id=self.agent.instance_id,
            agent_metadata_b64=self.agent.metadata_b64(),
            pool_info_b64=self.agent.pool_info_b64(),
            layout=self.agent.layout,
        )

    def check_ledger(self) -> None:
        """While idle, every page must be free or cached exactly once (common/kv/integrity.py)."""
        problems = self.ledger_check(not self.has_work(), self.scheduler.ledger_violations)
        if problems:
            self.outbox.append(KVIntegrity(len(problems)))

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
        reply = run_command(self.handlers, msg, self.role)
        if reply is not None:
            self.outbox.append(reply)

    def _stop(self, cmd: Stop) -> None:
        self.stopping = True

    def _abort(self, cmd: Abort) -> None:
        self.abort(cmd.req_id, cmd.reason, cmd.error)

    def shutdown(self) -> None:
        if self.stack_samples is not None:
            self.stack_samples.stop()
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
