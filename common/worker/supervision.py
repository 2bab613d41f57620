"""The engine's supervision by its control plane (``keep_engine``).

An engine process that dies after it was ready (kill -9, the OOM killer, a crash) is seen within 0.1 s (its
process is gone or its pipe closed) and started again: meanwhile the worker answers ``/ready`` 503 and
``/load`` without the dead engine's numbers, its streams end with a retryable error (the router continues
them elsewhere), and ``/health`` stays 200 so a kubelet leaves the pod alone (common/worker/probes.py). An
engine that cannot be restarted (``KVFERRY_ENGINE_RESTARTS`` failed starts in a row) makes the worker exit
non-zero, as one that fails its first start does, and the supervisor (kubelet, ``kvferry up``) restarts the
worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from common.worker.worker_state import WorkerState

log = logging.getLogger("kvferry.control")

ENGINE_START_FAILED_EXIT = 3


ENGINE_RESTART_FAILED_EXIT = 4
ENGINE_WATCH_S = 0.1
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0)  # before the 1st, 2nd, ... start in a row that failed


def _exit_worker(code: int) -> None:
    for logger in (logging.getLogger(), logging.getLogger("kvferry")):
        for handler in logger.handlers:
            handler.flush()
    os._exit(code)


async def keep_engine(state: WorkerState) -> None:
    """Watches the engine process and starts it again when it dies after it was ready.

    An engine that exits before its first ready (bad model path, out of device memory, a CUDA error in graph
    capture) would fail again: the worker exits non-zero at once, with the cause in the log (the engine
    logged its traceback), so a supervisor or Kubernetes sees a failed start. One that dies later (kill -9,
    the OOM killer) is started again at once; a restart that dies before it is ready, or is not ready within
    ``engine_start_timeout_s``, is retried after a back-off, and after ``engine_restarts`` such failures in a
    row the worker exits non-zero for its supervisor to restart it."""
    cfg = state.cfg
    failed = 0  # restarts in a row that died before they were ready
    while True:
        await asyncio.sleep(ENGINE_WATCH_S)
        if state.alive:
            if state.engine_ready.is_set():
                failed = 0
            elif state.restarting and time.monotonic() - state.engine_started_at > cfg.engine_start_timeout_s:
                log.error("restarted engine not ready in time; killing it", extra={"role": cfg.role})
                assert state.proc is not None
                state.proc.kill()
            continue
        if state.draining or state.proc is None:
            continue  # shutting down: the engine stops with the worker
        exitcode = state.proc.exitcode
        if not state.ever_ready:
            log.error(
                "engine process exited before it was ready; the worker exits",
                extra={"role": cfg.role, "exitcode": exitcode},
            )
            _exit_worker(ENGINE_START_FAILED_EXIT)
        if state.restarting:
            failed += 1
        if failed >= cfg.engine_restarts:
            log.error(
                "engine could not be restarted; the worker exits",
                extra={"role": cfg.role, "pod": cfg.pod_name, "failed_starts": failed, "exitcode": exitcode},
            )
            _exit_worker(ENGINE_RESTART_FAILED_EXIT)
        delay = RESTART_BACKOFF_S[min(failed, len(RESTART_BACKOFF_S) - 1)]
        if state.client is not None and not state.client.closed.is_set():
            state.proc.kill()  # a pipe still open: the reader ends its streams once the process is gone
            try:
                async with asyncio.timeout(5.0):
                    await state.client.closed.wait()
            except TimeoutError:
                pass
        state.forget_engine()
        state.restarting = True
        state.restarts += 1
        state.metrics.engine_restarts.inc()
        log.warning(
            "engine process died; restarting it",
            extra={
                "role": cfg.role,
                "pod": cfg.pod_name,
                "exitcode": exitcode,
                "restart": state.restarts,
                "delay_s": delay,
            },
        )
        if delay:
            await asyncio.sleep(delay)
        if not state.draining:
            state.start_engine()
