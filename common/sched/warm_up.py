"""A worker's step shapes run once before it serves, so the first users do not pay for compiling them: what
runs eagerly around the CUDA graphs (a mixed step's attention, the LM head, sampling and penalty kernels) met
its kernels during the first users' steps. A throwaway scheduler over the same runner decodes a few batches
beside an arriving prompt; nothing of it stays.

On a GPU the last batch is the fullest the engine runs (`max_running`). A mixed step's LM head writes eager
logits, one row per sampled request (~0.75 MB a row for a 128k vocabulary, bf16 then float32), and the device's
caching allocator serves a tensor larger than any it has cached from a new segment, keeping the smaller ones. A
batch growing row by row under load caches a new segment every few rows (sizes round to 2 MB: ~3.5 GB by 210
rows) in the room the KV pool leaves (common/engine/kv_sizing.py); once an allocation fails there, the allocator
frees every cached block and synchronizes, a host stall shared by every stream (`alloc_retries` on /load). Made
once at the largest size, those blocks are split for every smaller batch and merge back when freed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from common.engine.runner import ModelRunner
from common.protocol import SamplingParams
from common.sched.request import Req
from common.sched.scheduler import RequestRejected, Scheduler
from common.settings import SchedulerConfig

log = logging.getLogger("kvferry.engine")

WARM_UP_BATCHES = (1, 3, 8, 20)  # decoding requests beside the arriving prompt: one row, a few, one tile, more
STREAM_TOKENS = 24  # each decoding request's output (enough steps for the prompt's chunks to ride along)
WARM_UP_PENALTIES = {"frequency_penalty": 0.2, "presence_penalty": 0.1, "repetition_penalty": 1.1}


@dataclass(frozen=True)
class WarmUpReport:
    seconds: float
    steps: int
    kinds: dict[str, int]
    # The fastest prefill-only step, warm, at the warm-up's longest prompt: what the serving scheduler's budget
    # starts from (common/sched/prefill_budget.py bounds its step model by it; short prompts alone are slower
    # per token, so the first requests' own speed would understate it).
    prefill_tokens_per_s: float = 0.0
    widest_mixed_rows: int = 0  # the most requests one mixed step ran (decoding rows and prompts)


def warm_up_batches(max_running: int, fullest: bool = False) -> list[int]:
    """Decoding requests in each phase, each beside one arriving prompt; `fullest`: last, every other slot."""
    batches = [b for b in WARM_UP_BATCHES if b + 1 <= max_running]
    if (fullest or not batches) and max_running > 1 and max_running - 1 not in batches:
        batches.append(max_running - 1)
    return batches


def warm_up(runner: ModelRunner, cfg: SchedulerConfig, seed: int = 0, fullest: bool | None = None) -> WarmUpReport:
    """Runs the synthetic workload on `runner` (no prefix cache, host tier or transfer); checks all came back.
    `fullest` (default: on a GPU) ends with a batch of every slot, the allocator's largest eager tensors."""
    start = time.perf_counter()
    if fullest is None:
        fullest = runner.device.type == "cuda"
    sched = Scheduler(runner, replace(cfg, enable_prefix_cache=False, host_kv_gb=0, preempt_mode="recompute"))
    ps = runner.cfg.page_size
    g = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    # The arriving prompt spans a few chunks beside decoding, within the context and the pool.
    room = runner.max_seq_len - STREAM_TOKENS
    stream_len = max(1, min(2 * ps, room))
    prompt_len = max(1, min(cfg.max_prefill_tokens, 1024, room, runner.pool.num_pages * ps // 4))
    kinds: dict[str, int] = {}
    steps = widest = 0

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    def run_until(done) -> None:
        nonlocal steps, widest
        while sched.has_work() and not done():
            sched.step()
            steps += 1
            kinds[sched.processed_kind or "none"] = kinds.get(sched.processed_kind or "none", 0) + 1
            plan = sched.last_plan
            if plan is not None and plan.kind == "mixed":
                widest = max(widest, len(plan.decode) + len(plan.chunks))

    for b in warm_up_batches(runner.cfg.max_running, fullest):
        streams = [
            Req(
                f"warm-up-{b}-{i}",
                ids(stream_len),
                SamplingParams(
                    max_tokens=STREAM_TOKENS,
                    ignore_eos=True,
                    temperature=0.0 if i % 2 == 0 else 0.8,
                    top_p=1.0 if i % 2 == 0 else 0.9,
                    seed=i,
                    **(WARM_UP_PENALTIES if i % 3 == 2 else {}),
                ),
            )
            for i in range(b)
        ]
        try:
            for r in streams:
                sched.add(r)
        except RequestRejected as e:  # an engine too small for this phase: the phases before it ran
            log.info("warm-up stopped early", extra={"reason": str(e)})
            break
        run_until(lambda streams=streams: all(r.output_ids for r in streams))  # they decode now
        sched.add(Req(f"warm-up-{b}-prompt", ids(prompt_len), SamplingParams(max_tokens=2, ignore_eos=True)))
        run_until(lambda: False)
    run_until(lambda: False)  # after a phase stopped early: the streams it did add
    try:  # one prompt alone, every kernel warm: a full-size prefill-only step, timed
        sched.add(Req("warm-up-alone", ids(prompt_len), SamplingParams(max_tokens=1, ignore_eos=True)))
    except RequestRejected as e:
        log.info("warm-up stopped early", extra={"reason": str(e)})
    run_until(lambda: False)
    leaks = sched.ledger_violations()
    if leaks or sched.allocator.num_free != runner.pool.num_pages:
        raise RuntimeError(f"the warm-up did not give its pages back: {leaks}")
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    report = WarmUpReport(
        round(time.perf_counter() - start, 3), steps, kinds, sched.pacing.prefill_speed.peak_tokens_per_s, widest
    )
    log.info(
        "warm-up ran every step shape",
        extra={"seconds": report.seconds, "steps": steps, "kinds": kinds, "widest_mixed_rows": widest},
    )
    return report
