"""Where a process's main thread spends its host time, sampled (KVFERRY_STACK_SAMPLES: a file; off by default).

A step whose launch takes tens of ms of host time shows in a step trace as `launch_host_s` but not why. A thread
wakes every `period_s`, reads the main thread's stack and appends it as one line, `<wall clock> <outermost;...;
innermost>` (the collapsed format flame-graph tools read), unless the thread is only waiting (on the engine's pipe,
an event, the device). A call that holds the GIL shows as a hole in the timestamps, with the frame before it."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType

__all__ = ["StackSamples"]

# innermost frames that only wait: not host work, not written
WAITING = frozenset({"poll", "_poll", "wait", "synchronize", "select", "sleep", "recv_bytes", "_recv", "get"})


@dataclass
class StackSamples:
    path: str
    period_s: float = 0.001
    depth: int = 16  # frames kept, innermost first
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> StackSamples:
        if self._thread is None:
            main = threading.main_thread().ident
            self._thread = threading.Thread(target=self._run, args=(main,), name="stack-samples", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def _run(self, main: int | None) -> None:
        with open(self.path, "a", buffering=1 << 16) as out:
            while not self._stop.wait(self.period_s):
                frame = sys._current_frames().get(main) if main is not None else None
                line = self.collapsed(frame)
                if line:
                    out.write(f"{time.time():.4f} {line}\n")

    def collapsed(self, frame: FrameType | None) -> str:
        names: list[str] = []
        while frame is not None and len(names) < self.depth:
            code = frame.f_code
            names.append(f"{code.co_name}@{os.path.basename(code.co_filename)}:{frame.f_lineno}")
            frame = frame.f_back
        if not names or names[0].split("@", 1)[0] in WAITING:
            return ""
        return ";".join(reversed(names))
