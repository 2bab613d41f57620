"""The engine process's loop (``engine_main``). Each turn drains commands, advances transfers, runs one scheduler
step when there is work, and reports what happened in one message. Between turns it waits for a command as
long as nothing else is due (``EngineLoop.wait_s``): not at all while steps wait, briefly while only transfers or
grammar compiles are under way, and, idle, until the next load report, blocking on the pipe (no polling).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from common.config import WorkerConfig
from common.engine.threads import apply_engine_threads
from common.engine.tp_ranks import TPRankLost
from common.log import setup_logging
from common.settings_registry import TORCH_THREADS
from common.worker.channel import recv, send
from common.worker.engine_host import EngineHost
from common.worker.messages import Ready, Stopping

log = logging.getLogger("kvferry.engine")

# A turn whose only work waits on transfers (a KV notice, writes in flight): NIXL has no descriptor to block
# on, so the loop polls this often, waking at once for a command; a zero wait spun a core a peer needed.
TRANSFER_POLL_S = 0.001
# A turn with nothing to do but wait for staging space (prefill_worker/engine.py, `waits_only`) waits this long for
# a command first, instead of polling its writes again at once: the space comes back only as they complete.
STAGING_WAIT_S = 0.0005
COMPILE_POLL_S = 0.002  # a turn whose only work is a grammar compiling off the loop waits this long for a command
# An idle turn page-locks the host KV tier for at most about this long before it looks for commands again, and
# stops sooner once one is waiting (common/kv/host_tier.py `lock_some`: at least one 32 MiB piece, ~10 ms).
HOST_LOCK_TURN_S = 0.05
IDLE_TRIM_S = 1.0  # idle this long: hand the allocator's free memory back to the OS (once per idle spell)


def _malloc_trim() -> None:
    """glibc keeps freed heap memory for reuse; a CPU engine serving steps of ever-changing shapes ends up
    holding hundreds of MB of it (soak: decode RSS +372 MB over 1,500 requests, +112 MB with forced mmap,
    which halved throughput). Trimming while idle returns it without slowing the steps."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class EngineLoop:
    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.last_busy = time.monotonic()  # when the latest turn with work began
        self.trimmed = True  # the allocator was trimmed since then (reported in /load as idle_trimmed)

    def run(self) -> None:
        host = self.host
        host.publisher.start()
        send(host.conn, Ready(host.agent_info(), host.cfg.pod_name, host.runner.start_phases.seconds))
        self.last_busy, self.trimmed = time.monotonic(), True
        while not host.stopping:
            self.turn()
        host.shutdown()

    def turn(self) -> None:
        host = self.host
        host.loop_turns += 1
        busy = host.has_work()
        now = time.monotonic()
        if busy:
            self.last_busy, self.trimmed = now, False
        elif not self.trimmed and now - self.last_busy >= IDLE_TRIM_S:
            _malloc_trim()
            self.trimmed = True
        if not busy and host.scheduler.host_tier_locking() and not host.conn.poll(0):
            # a command arriving mid-turn ends it after the piece under way (common/kv/host_tier.py)
            host.scheduler.lock_host_tier(HOST_LOCK_TURN_S, waiting=lambda: host.conn.poll(0))
        timeout = self.wait_s(busy, now)
        while host.conn.poll(timeout):
            host.handle(recv(host.conn))
            timeout = 0.0
        host.tick()
        host.settle()
        host.check_ledger()
        if host.outbox:
            # What the tick produced (a first token whose KV just landed) goes out now, not after the
            # next model step: measured on the CPU, waiting for it added one decode step to TTFT.
            host.flush()
        if host.scheduler.has_work():
            self.step()
        for rid, error in host.scheduler.take_compile_failures():
            host.abort(rid, "error", error)  # through its role: a prefill for a peer ends its session too
        for tier, hashes in host.scheduler.take_index_events():
            if tier is None:
                host.publisher.removed(hashes)
            else:
                host.publisher.stored(hashes, tier)  # moved to the host tier, or loaded back
        host.outbox += host.report.due(host.loop_turns, time.monotonic(), self.last_busy, self.trimmed)
        host.flush()

    def step(self) -> None:
        host = self.host
        try:
            host.step_started = started = time.time()
            events = host.scheduler.step()
            host.report.observe_step(started, events)
            host.note_admissions()
            host.emit_step_events(events)
        except TPRankLost:
            # This worker cannot compute any more: fail what is in flight, then exit, so /health turns
            # 503 and the pod is restarted (a live process answering only errors would keep traffic).
            log.exception("a tensor-parallel rank is gone; the engine stops")
            send(host.conn, Stopping("a tensor-parallel rank of this worker exited"))
            host.fail_all("a tensor-parallel rank of this worker exited")
            host.flush()
            raise
        except Exception:
            # A step that raised left its batch in an unknown state: fail the requests in flight (their
            # pages come back) and keep serving, rather than take the whole worker down.
            log.exception("scheduler step failed; aborting the requests in flight")
            host.fail_all("internal error in the engine step")

    def wait_s(self, busy: bool, now: float) -> float:
        """How long this turn waits for a command before it moves on: not at all while the scheduler has
        steps to run; briefly while only transfers are under way; idle, until the next thing with a time
        (the load snapshot, the allocator trim), blocking on the pipe meanwhile (no polling)."""
        host = self.host
        if host.scheduler.has_work() and not host.scheduler.compiling_only():
            return 0.0
        if busy and not any(r.has_work() for r in host.roles):
            return COMPILE_POLL_S  # only grammars compiling (on a worker thread): no spinning beside them
        if busy:
            waiting = [r for r in host.roles if r.has_work()]
            return STAGING_WAIT_S if all(r.waits_only() for r in waiting) else TRANSFER_POLL_S
        if host.scheduler.host_tier_locking():
            return 0.0  # idle, with the host tier still to page-lock: the next turn locks more of it
        due = host.report.next_due(self.last_busy)
        if not self.trimmed:
            due = min(due, self.last_busy + IDLE_TRIM_S)
        return max(0.0, due - now)


def engine_main(roles: Sequence[type], cfg: WorkerConfig, conn: Connection, spawned_at: float | None = None) -> None:
    """Entry point of the engine process (multiprocessing spawn target); `spawned_at`: the worker's time.time() when
    it spawned this process (its start until here, the interpreter and the imports, is the `process` phase)."""
    process_s = time.time() - spawned_at if spawned_at is not None else None
    setup_logging()
    # oneDNN keeps up to 1024 compiled primitives, one per GEMM shape; a CPU engine sees a new shape at
    # almost every step, and the cache held ~150 MB more after a 1,500-request soak (+113 MB instead of
    # +260 MB at 64 entries, same req/s; bench/engine_cpu.py 230 vs 231 tok/s). Read at its first use,
    # inherited by tensor-parallel ranks; an operator's own setting wins.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    threads = apply_engine_threads(cfg.runner.device, TORCH_THREADS.read())
    log.info("engine threads", extra={"torch_threads": threads, "device": cfg.runner.device})
    try:
        EngineLoop(EngineHost(cfg, conn, roles, process_s)).run()
    except Exception:
        log.exception("engine process failed")
        raise
