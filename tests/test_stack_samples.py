"""KVFERRY_STACK_SAMPLES: the engine's main thread sampled while it works on the host, not while it waits."""

from __future__ import annotations

import threading
import time

from common.observability.stack_samples import StackSamples


def _spin_on_the_host(seconds: float) -> int:
    x, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        x += sum(range(1000))
    return x


def test_samples_name_the_function_the_main_thread_is_busy_in_and_skip_its_waits(tmp_path) -> None:
    path = tmp_path / "stacks.txt"
    samples = StackSamples(str(path)).start()
    try:
        _spin_on_the_host(0.3)
        threading.Event().wait(0.3)  # only waiting: nothing written
    finally:
        samples.stop()
    lines = path.read_text().splitlines()
    busy = [ln for ln in lines if "_spin_on_the_host@test_stack_samples.py" in ln]
    assert len(busy) >= 10  # ~60 at the interpreter's 5 ms switch interval
    stamps = [float(ln.split(" ", 1)[0]) for ln in lines]
    assert stamps == sorted(stamps) and abs(stamps[0] - time.time()) < 60
    assert not any(ln.rsplit(";", 1)[-1].startswith("wait@") for ln in lines)
    # outermost first: this test's frame comes before the function it called
    first = busy[0].split(" ", 1)[1].split(";")
    assert first[-1].startswith("_spin_on_the_host@") and any(f.startswith("test_samples_name") for f in first[:-1])
