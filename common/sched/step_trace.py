"""Timed steps written out as JSON lines (KVFERRY_STEP_TRACE): what the step-time model saw and predicted, so a
budget that misses its target can be read step by step and a better model fitted offline. Off by default; on, one
buffered line per step."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import IO

from common.sched.step_model import StepShape

__all__ = ["StepTrace"]


@dataclass
class StepTrace:
    path: str
    _file: IO[str] | None = field(default=None, repr=False)

    def write(
        self,
        kind: str,
        shape: StepShape,
        device_s: float,
        gap_s: float,
        predicted_s: float,
        target_s: float,
        host_s: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """`host_s`: the step's launch and the previous step's processing on the host (Launched's)."""
        if self._file is None:
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - line-buffered: a killed engine keeps its lines
        row = {
            "t": round(time.time(), 4),  # wall clock as the step was processed: lines up with a client's token gaps
            "kind": kind,
            "prefill_tokens": shape.prefill_tokens,
            "decode_rows": shape.decode_rows,
            "decode_context": shape.decode_context,
            "chunk_attention": shape.chunk_attention,
            "device_s": round(device_s, 6),
            "gap_s": round(gap_s, 6),
            "predicted_s": round(predicted_s, 6),
            "target_s": round(target_s, 6),
            "launch_host_s": round(host_s[0], 6),
            "process_host_s": round(host_s[1], 6),
        }
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
