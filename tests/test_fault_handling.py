"""Fast checks of the pieces that turn faults into something recoverable, on real pipes and processes: an engine
call that is never answered, an engine that exits under open streams, and the supervisor of `kvferry up`
restarting a part that keeps exiting, with back-off."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
from pathlib import Path

import pytest

from common.devcluster.process import ManagedProcess, wait_ready
from common.devcluster.supervisor import Supervisor
from common.net import free_port
from common.protocol import SamplingParams
from common.worker.channel import ENGINE_TIMEOUT, EngineClient, EngineError
from common.worker.messages import Generate, Stop, Tokens


def test_an_unanswered_engine_call_is_a_retryable_engine_error_not_a_timeout() -> None:
    async def run() -> EngineError:
        ours, theirs = mp.Pipe(duplex=True)  # nobody answers on `theirs`
        client = EngineClient(ours, asyncio.get_running_loop(), lambda _m: None)
        try:
            with pytest.raises(EngineError) as info:
                await client.call(Generate("r", [1], SamplingParams()), timeout=0.2)
            return info.value
        finally:
            theirs.close()
            ours.close()

    err = asyncio.run(run())
    assert err.code == ENGINE_TIMEOUT
    assert "'generate'" in str(err) and "0.2" in str(err)


def test_engine_exit_ends_open_streams_with_a_retryable_error() -> None:
    async def run() -> Tokens:
        ours, theirs = mp.Pipe(duplex=True)
        client = EngineClient(ours, asyncio.get_running_loop(), lambda _m: None)
        queue = client.open_stream("r")
        theirs.close()  # the engine process is gone
        msg = await asyncio.wait_for(queue.get(), 5)
        with pytest.raises(EngineError):
            await client.call(Stop(), timeout=5)
        ours.close()
        return msg

    msg = asyncio.run(run())
    assert isinstance(msg, Tokens) and msg.line.finish_reason == "error" and msg.line.retryable is True


# A part that exits with code 3 on its first `fail_runs` starts (counted in a file), then serves /ready.
FLAKY = """
import http.server, pathlib, sys
runs_file, fail_runs, port = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
runs = int(runs_file.read_text()) if runs_file.exists() else 0
runs_file.write_text(str(runs + 1))
if runs < fail_runs:
    print("bye", flush=True)
    raise SystemExit(3)


class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.end_headers()


http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
"""


def test_supervisor_restarts_an_exiting_part_with_back_off(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-c", FLAKY, str(tmp_path / "runs"), "2", str(port)]
    part = ManagedProcess("flaky", argv, {}, tmp_path / "f.log", url=f"http://127.0.0.1:{port}")
    part.start()
    try:
        assert part.proc is not None
        pids = [part.proc.pid]
        part.proc.wait(10)
        said: list[str] = []
        sup = Supervisor([part], said.append, backoff_s=(1.0, 2.0), stable_s=60.0)
        t = 1000.0
        sup.check(t)  # noticed: restart due in 1 s
        assert "flaky exited (code 3); restarting it in 1 s" in said[-1] and "bye" in said[-1]
        sup.check(t + 0.5)
        assert sup.restarts == {"flaky": 0} and part.proc.pid == pids[-1]  # still backing off: not started
        sup.check(t + 1.0)
        assert sup.restarts == {"flaky": 1} and "restarted" in said[-1]
        assert part.proc.pid not in pids  # a new process
        pids.append(part.proc.pid)
        part.proc.wait(10)  # its second run exits too
        sup.check(t + 1.5)  # exited again at once: the back-off doubles
        assert "restarting it in 2 s" in said[-1]
        sup.check(t + 3.0)
        assert sup.restarts == {"flaky": 1} and part.proc.pid == pids[-1]
        sup.check(t + 3.5)
        assert sup.restarts == {"flaky": 2} and part.proc.pid not in pids
        wait_ready([part], timeout_s=30)  # the third run serves: the restart brought the part back
        assert (tmp_path / "runs").read_text() == "3"
        sup.check(t + 4.0)
        assert part.alive() and sup.restarts == {"flaky": 2}  # serving: left alone
    finally:
        part.kill_group()


def test_supervisor_leaves_a_running_part_alone(tmp_path: Path) -> None:
    part = ManagedProcess("steady", [sys.executable, "-c", "import time; time.sleep(30)"], {}, tmp_path / "s.log")
    part.start()
    try:
        said: list[str] = []
        sup = Supervisor([part], said.append)
        for _ in range(3):
            sup.check()
        assert said == [] and sup.restarts == {"steady": 0} and part.alive()
    finally:
        part.kill_group()
