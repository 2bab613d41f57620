"""A tensor-parallel follower rank: builds its part of the model, then replays rank 0's steps until told to stop.
A layer above the engine that needs more per follower (the per-rank NIXL agent) runs its own module that starts
a `Follower` the same way.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from common.engine.runner import ModelRunner
from common.engine.step_channel import StepChannel
from common.engine.tp_ranks import (
    HEADER_LEN,
    OP_SIDE,
    OP_STEP_BIG,
    OP_STOP,
    STEP_CHANNEL_WORDS,
    decode_step,
    payload_parts,
)
from common.log import setup_logging
from common.settings import RunnerConfig
from common.settings_registry import HANG_DUMP_S, TORCH_THREADS, TP_PARENT


def _exit_with_parent(parent: int) -> None:
    """A follower must not outlive rank 0 (kill -9 of the worker leaves it blocked in a broadcast)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


@dataclass
class Follower:
    runner: ModelRunner
    channel: StepChannel
    rank: int

    @classmethod
    def start(cls, spec: dict[str, Any]) -> Follower:
        """Joins rank 0's group as `spec["tp_rank"]` and builds this rank's model and pool."""
        setup_logging()
        faulthandler.enable()
        if HANG_DUMP_S.read() > 0:  # diagnosing a stuck rank: print every thread's stack then exit
            faulthandler.dump_traceback_later(HANG_DUMP_S.read(), exit=True)
        parent = TP_PARENT.read() or os.getppid()
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="tp-parent-watch").start()
        torch.set_num_threads(max(1, TORCH_THREADS.read()))
        spec = dict(spec)
        # Mapped before the model is built: rank 0 unlinks the file once every rank answers READY.
        channel = StepChannel(str(spec.pop("tp_steps")), int(spec["tp_size"]), STEP_CHANNEL_WORDS, create=False)
        runner = ModelRunner(RunnerConfig(**spec))
        return cls(runner, channel, int(spec["tp_rank"]))

    def serve(
        self,
        on_stop: Callable[[], None] | None = None,
        on_side: Callable[[bytes], None] | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> NoReturn:
        """Replays steps until STOP, then runs `on_stop` and exits; `on_side` gets the layer above's messages,
        `on_idle` runs between polls."""
        runner = self.runner
        while True:
            message = self.channel.recv(self.rank, on_idle)
            header = message[:HEADER_LEN]
            op = int(header[0])
            if op == OP_STOP:
                if on_stop is not None:
                    on_stop()
                runner.tp.close()
                os._exit(0)  # skip interpreter teardown: nothing is left to flush, and NCCL's can block
            if op == OP_SIDE:
                if on_side is not None:
                    on_side(message[HEADER_LEN:].numpy().tobytes()[: int(header[1])])
                if on_idle is not None:
                    on_idle()
                continue
            if op == OP_STEP_BIG:
                payload = torch.empty(sum(payload_parts(header)), dtype=torch.int64)
                runner.tp.broadcast(payload)
            else:
                payload = message[HEADER_LEN:]
            step = decode_step(header, payload)
            for row, first, pages in step.journal:
                runner.page_table.write_pages(row, first, pages)
            runner.forward_local(runner.batch_from_inputs(step.inputs))
            if on_idle is not None:
                on_idle()


def main(argv: list[str]) -> NoReturn:
    Follower.start(json.loads(argv[0])).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
