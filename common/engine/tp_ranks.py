"""The ranks of one tensor-parallel worker: rank 0 (the engine: scheduler, pages, sampling, NIXL) decides and
broadcasts each step (its `StepInputs` and page-table writes, as int64 words in a shared-memory channel, never
pickled); followers apply the writes and run the same forward. On the CPU every rank's pool is a shared file
rank 0 maps, so its NIXL agent moves every rank's heads.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.engine.dtypes import resolve_dtype
from common.engine.forward_batch import StepInputs
from common.engine.kv_sizing import model_kv_layout
from common.engine.model_config import ModelConfig
from common.engine.step_channel import StepChannel
from common.engine.tp import TPGroup, TPShard, tp_backend
from common.settings_registry import TORCH_THREADS, TP_PARENT

if TYPE_CHECKING:
    from common.settings import RunnerConfig

log = logging.getLogger("kvferry.engine")

OP_STEP, OP_STOP, OP_READY, OP_STEP_BIG = 1, 2, 3, 4  # BIG: the payload follows over gloo (too big for shm)
OP_SIDE = 5  # a message for the layer above the engine in each follower (header[1] bytes follow the header)
STEP_CHANNEL_WORDS = 1 << 20  # 8 MiB: any decode step, and prefill steps up to ~200k tokens
HEADER_LEN = 8  # op, is_decode, batch, tokens, journal entries, journal pages, all_logits, scored

Journal = list[tuple[int, int, torch.Tensor]]


class TPRankLost(RuntimeError):
    """A follower rank exited: this worker cannot compute any more and must be restarted."""


@dataclass
class ReceivedStep:
    inputs: StepInputs
    journal: Journal


def encode_step(inputs: StepInputs, journal: Journal) -> np.ndarray:
    """The step as one int64 array: an 8-word header, then the payload."""
    pages = [j[2].numpy() for j in journal]
    jp = sum(len(p) for p in pages)
    header = [OP_STEP, int(inputs.is_decode), inputs.extend_lens.numel(), inputs.input_ids.numel()]
    header += [len(journal), jp, int(inputs.all_logits), int(inputs.score_lens is not None)]
    parts = [
        np.array(header, dtype=np.int64),
        inputs.input_ids.numpy(),
        inputs.extend_lens.numpy(),
        inputs.starts.numpy(),
        inputs.table_rows.numpy(),
        inputs.sample_mask.numpy().astype(np.int64),
        *([inputs.score_lens.numpy()] if inputs.score_lens is not None else []),
        np.array([j[0] for j in journal], dtype=np.int64),
        np.array([j[1] for j in journal], dtype=np.int64),
        np.array([len(p) for p in pages], dtype=np.int64),
        *pages,
    ]
    return np.concatenate(parts)


def payload_parts(header: torch.Tensor) -> tuple[int, ...]:
    _, _, b, t, j, jp, _, scored = (int(v) for v in header[:8])
    return (t, b, b, b, b, b if scored else 0, j, j, j, jp)


def decode_step(header: torch.Tensor, payload: torch.Tensor) -> ReceivedStep:
    is_decode, all_logits = int(header[1]), int(header[6])
    ids, ext, starts, rows, mask, scored, jrows, jfirst, jcount, jpages = payload.split(payload_parts(header))
    score_lens = scored if int(header[7]) else None
    inputs = StepInputs(bool(is_decode), ids, ext, starts, rows, mask.to(torch.bool), bool(all_logits), score_lens)
    journal = list(zip(jrows.tolist(), jfirst.tolist(), jpages.split(jcount.tolist())))
    return ReceivedStep(inputs, journal)


def shared_dir(cfg: RunnerConfig, model_cfg: ModelConfig) -> str:
    """Where the ranks' shared files go: /dev/shm when it has room (a full tmpfs kills the writer with SIGBUS;
    a container's default is 64 MiB), else the temp dir."""
    need = STEP_CHANNEL_WORDS * 8
    if not cfg.device.startswith("cuda"):
        dtype = resolve_dtype(cfg.dtype, torch.device("cpu"))
        full = model_kv_layout(model_cfg, cfg.page_size, dtype)
        per_page = full.bytes_per_token * cfg.page_size  # every rank's heads together
        pools = cfg.num_pages * per_page if cfg.num_pages else int(cfg.kv_memory_gb * (1 << 30)) * cfg.tp_size
        need += int(pools * 1.25)  # replicated heads and rounding
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize >= need:
            return "/dev/shm"
    except OSError:
        pass
    log.warning("/dev/shm lacks room for the tensor-parallel KV pools; using %s", tempfile.gettempdir())
    return tempfile.gettempdir()


def shared_pool_path(prefix: str, rank: int) -> str:
    return f"{prefix}-rank{rank}"


class TPFollowers:
    def __init__(
        self, group: TPGroup, procs: list[subprocess.Popen[bytes]], shm_prefix: str, channel: StepChannel
    ) -> None:
        self.group = group
        self.procs = procs
        self.shm_prefix = shm_prefix
        self.channel = channel
        self._checked_at = 0.0
        self._closed = False

    @classmethod
    def launch(cls, cfg: RunnerConfig, model_cfg: ModelConfig) -> TPFollowers:
        """Starts ranks 1..N-1 of `cfg` and joins their group as rank 0."""
        size = cfg.tp_size
        store = TPGroup.serve_store("127.0.0.1", size)
        port = store.port
        shm_prefix = os.path.join(shared_dir(cfg, model_cfg), f"kvferry-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        threads = max(1, torch.get_num_threads() // size)
        torch.set_num_threads(threads)
        channel = StepChannel(f"{shm_prefix}-steps", size, STEP_CHANNEL_WORDS, create=True)
        procs = []
        for rank in range(1, size):
            spec = {**asdict(cfg), "tp_rank": rank, "tp_port": port, "tp_shm": shm_prefix, "tp_steps": channel.path}
            env = {**os.environ, TORCH_THREADS.name: str(threads), TP_PARENT.name: str(os.getpid())}
            argv = [sys.executable, "-m", cfg.tp_follower_main, json.dumps(spec)]
            procs.append(subprocess.Popen(argv, env=env))
        backend = tp_backend(cfg)
        try:
            group = TPGroup.connect(TPShard.plan(model_cfg, 0, size), "127.0.0.1", port, backend, store=store)
        except Exception:
            for p in procs:
                p.kill()
            channel.unlink()
            raise
        log.info("tensor-parallel group up", extra={"size": size, "backend": backend})
        return cls(group, procs, shm_prefix, channel)

    def check_alive(self, wait_s: float = 0.0) -> None:
        """Raises TPRankLost if a follower has exited (waiting up to `wait_s` for a dying one)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None:
                    raise TPRankLost(f"tensor-parallel rank {rank} exited with code {code}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def send_step(self, inputs: StepInputs, journal: Journal) -> None:
        now = time.monotonic()
        if now - self._checked_at > 0.5:  # a lost rank also shows as a failing collective (ModelRunner.forward)
            self._checked_at = now
            self.check_alive()
        message = encode_step(inputs, journal)
        if message.size <= self.channel.capacity:
            self.channel.send(message, self.check_alive)
            return
        header = message[:HEADER_LEN].copy()
        header[0] = OP_STEP_BIG
        self.channel.send(header, self.check_alive)
        self.group.broadcast(torch.from_numpy(message[HEADER_LEN:].copy()))

    def send_side(self, payload: bytes) -> None:
        """A message for the followers' layer above the engine, handled after every step sent before it."""
        pad = (-len(payload)) % 8
        words = np.frombuffer(payload + b"\0" * pad, dtype=np.int64)
        header = np.array([OP_SIDE, len(payload)] + [0] * (HEADER_LEN - 2), dtype=np.int64)
        self.channel.send(np.concatenate((header, words)), self.check_alive)

    def barrier_ready(self) -> None:
        """Waits until every follower built its model and pool (and mapped the step channel, whose file can go)."""
        self.group.broadcast(torch.tensor([OP_READY] + [0] * (HEADER_LEN - 1), dtype=torch.int64))
        self.channel.unlink()

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if all(p.poll() is None for p in self.procs):
                stop = np.array([OP_STOP] + [0] * (HEADER_LEN - 1), dtype=np.int64)
                self.channel.send(stop, self.check_alive, timeout_s=timeout_s / 2)
        except Exception as e:  # a rank already gone: fall through to killing the rest
            log.warning("stopping tensor-parallel ranks: %s", e)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.group.close()
