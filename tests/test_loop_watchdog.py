"""The event loop's watchdog (common/loop_watchdog.py): a stuck loop's stacks are written, and with an exit limit
the process ends for its supervisor to replace; a loop that keeps running is left alone. Each case runs in a
process of its own: faulthandler's timer is one per process, and the exit ends it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from common.loop_watchdog import STALL_EXIT_CODE

REPO = Path(__file__).resolve().parents[1]

STUCK_LOOP = """
import asyncio, time
from common.log import setup_logging
from common.loop_watchdog import LoopWatchdog

def hold_the_loop(seconds):
    time.sleep(seconds)  # a blocking call on the loop: nothing else of the process runs meanwhile

async def main():
    dog = LoopWatchdog(dump_after_s={dump}, exit_after_s={exit})
    dog.start()
    await asyncio.sleep(0.1)
    hold_the_loop({hold})
    await asyncio.sleep(0.2)
    await dog.stop()
    await asyncio.sleep({after})

setup_logging()
asyncio.run(main())
print("ran to the end")
"""


def _run(dump: float, exit: float, hold: float, after: float = 0.0) -> subprocess.CompletedProcess[str]:
    code = STUCK_LOOP.format(dump=dump, exit=exit, hold=hold, after=after)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_stuck_loop_gets_every_threads_stack_written_and_a_warning_once_it_runs_again() -> None:
    run = _run(dump=0.5, exit=0, hold=2.0)
    assert run.returncode == 0 and "ran to the end" in run.stdout
    err = run.stderr
    assert "Timeout (0:00:00.500000)!" in err  # faulthandler's own thread wrote it, the loop still stuck
    assert "in hold_the_loop" in err and "in main" in err
    assert "event loop stalled" in err


def test_a_loop_stuck_past_the_exit_limit_ends_its_process_with_the_stacks_written() -> None:
    """What a router process does (`KVFERRY_ROUTER_STALL_EXIT_S`): its supervisor starts a fresh one."""
    run = _run(dump=0.5, exit=1.5, hold=30.0)
    assert run.returncode == STALL_EXIT_CODE and "ran to the end" not in run.stdout
    assert "exiting so a fresh process takes over" in run.stderr
    assert run.stderr.count("in hold_the_loop") >= 2  # at the dump's limit, and again as it exits


def test_a_loop_that_keeps_running_is_left_alone_during_and_after() -> None:
    """Busy but never stuck as long as either limit, then stopped: no stack, no exit, also after the stop."""
    busy = STUCK_LOOP.replace(
        "    hold_the_loop({hold})\n",
        "    for _ in range(10):\n        time.sleep(0.05)\n        await asyncio.sleep(0.05)\n",
    )
    code = busy.format(dump=0.3, exit=0.6, hold=0, after=1.0)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "ran to the end" in run.stdout
    assert "Timeout" not in run.stderr and "stuck" not in run.stderr and "stalled" not in run.stderr


def test_a_loop_on_a_background_thread_is_not_watched() -> None:
    """An app served on a thread of a host program (the tests' routers, router/server_thread.py) leaves the
    process-wide timer and the process's life to the host."""
    import asyncio
    import threading

    from common.loop_watchdog import LoopWatchdog

    seen: list[bool] = []

    def serve() -> None:
        async def main() -> None:
            dog = LoopWatchdog(dump_after_s=0.2, exit_after_s=0.4)
            dog.start()
            seen.append(dog._task is None and dog._guard is None)
            await dog.stop()

        asyncio.run(main())

    t = threading.Thread(target=serve)
    t.start()
    t.join(10)
    assert seen == [True]
