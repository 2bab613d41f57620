"""A launched step whose sampled tokens the host has not read yet, and the copies that bring them back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from common.sched.request import Req
from common.sched.step_model import StepShape
from common.sched.step_sampling import MaskJob


class Delivered(Protocol):
    """What a step computed beside its tokens, handed to its requests once the step is done on the device
    (common/sched/prompt_scores.py's `PromptScores`)."""

    def deliver(self) -> None: ...


@dataclass(eq=False)
class Launched:
    """A step on the device; `reqs` sample a token in it, in sampling order: its first `decode_rows` decode
    (one token each), the rest finish a prompt in it."""

    kind: str  # "prefill" | "decode" | "mixed" (decode rows and prompt chunks)
    reqs: list[Req]
    decode_rows: int = 0
    # Until sampled: the forward's logits, and what sampling reads that processing the step before changes
    # (table rows, given back when a request finishes; output steps). None once the step is sampled.
    logits: torch.Tensor | None = None
    rows: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    tokens: torch.Tensor | None = None  # [R] int64 on the host (pinned on CUDA), filled by a non-blocking copy
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    chunks: list[tuple[Req, int, int]] = field(default_factory=list)  # prefill: (request, start, end) per chunk
    done: torch.cuda.Event | None = None
    timer: StepTimer | None = None  # the forward's device time
    shape: StepShape = field(default_factory=StepShape)  # what it computes (the step-time model's inputs)
    launched_at: float = field(default_factory=time.perf_counter)  # host clock when its forward was launched
    masks: MaskJob | None = None  # its grammar masks, being filled while it waits for sampling
    scores: Delivered | None = None  # the prompt logprobs this step computed, on their way to the host
    # Host seconds: planning and launching this step, and processing the step processed last before it (its
    # tokens handed on; the wait for the device excluded). A step trace's line shows them (KVFERRY_STEP_TRACE).
    launch_host_s: float = 0.0
    process_host_s: float = 0.0

    def record_done(self, device: torch.device) -> None:
        """Marks the end of the step's device work (KV writes, sampling, copies to the host)."""
        if device.type == "cuda":
            self.done = torch.cuda.Event()
            self.done.record()

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


@dataclass(eq=False)
class StepTimer:
    """A forward's duration on the device: CUDA events (read once the step is done, so no extra sync), or the
    wall clock on the CPU, where the forward runs on the calling thread."""

    begin: torch.cuda.Event | float
    end: torch.cuda.Event | float | None = None

    @classmethod
    def start(cls, device: torch.device) -> StepTimer:
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return cls(ev)
        return cls(time.perf_counter())

    def stop(self) -> StepTimer:
        if isinstance(self.begin, float):
            self.end = time.perf_counter()
        else:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record()
        return self

    def seconds(self) -> float:
        if isinstance(self.begin, float):
            return float(self.end) - self.begin  # type: ignore[arg-type]
        assert isinstance(self.end, torch.cuda.Event)
        self.end.synchronize()  # a no-op once the step is done (the end precedes its done event)
        return self.begin.elapsed_time(self.end) / 1000


def copy_to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A non-blocking device-to-host copy into pinned memory (valid once the step's done event fired)."""
    if t is None or t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
