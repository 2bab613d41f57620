"""How many workers of each role an offered load needs, from the capacity model (common/capacity.py): pure
(the formulas: docs/architecture.md, "The planner"). The GPU cost of a plan is its replica counts times the GPUs
each takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from common.capacity import StepCost, prompt_steps_s

__all__ = [
    "Counts",
    "FleetSpec",
    "OfferedLoad",
    "decode_rate",
    "mixed_rate",
    "prefill_work_s",
    "prefill_workers",
    "reserve_fleet",
    "size_fleet",
    "wait_chance",
]

MAX_UTILISATION = 0.9  # a queue run hotter than this waits without bound on the first burst
ITL_HEADROOM = 0.8  # the share of the ITL target a mean step may take (the target holds at a percentile)
MIN_WAIT_SHARE = 0.1  # a prompt whose own prefill nearly fills the TTFT target still gets this much queue
QUEUE_TAIL = 3.0  # a queue's high-percentile wait over its mean


@dataclass(frozen=True)
class Counts:
    prefill: int = 0
    decode: int = 0
    mixed: int = 0

    def gpus(self, spec: FleetSpec) -> int:
        return spec.gpus_per_worker * (self.prefill + self.decode + self.mixed)

    def total(self) -> int:
        return self.prefill + self.decode + self.mixed


@dataclass(frozen=True)
class FleetSpec:
    """What every worker of the fleet can do (one model, one kind of device) and the SLOs it is held to."""

    cost: StepCost
    ttft_s: float
    itl_s: float
    chunk_tokens: int = 8192  # a prefill worker's prompt tokens per step
    max_running: int = 256  # decode batch slots per worker
    kv_tokens: int = 800_000  # KV pool per decode worker, in tokens
    transfer_tokens_per_s: float = 200_000.0
    gpus_per_worker: int = 1
    roles: tuple[str, ...] = ("prefill", "decode")  # which Deployments exist: prefill+decode, mixed, or all three
    min_workers: Counts = field(default_factory=lambda: Counts(1, 1, 1))
    max_workers: Counts = field(default_factory=lambda: Counts(10_000, 10_000, 10_000))
    percentile: float = 99.0  # the SLO's: this share of requests (in %) must meet the targets


@dataclass(frozen=True)
class OfferedLoad:
    rate: float  # requests/s
    prompt: float  # mean prompt tokens
    output: float  # mean output tokens
    prefix_hit: float = 0.0  # fraction of prompt tokens already cached
    prompt_sq: float = 0.0  # mean square of the prompt lengths (0: as if every prompt were the mean)

    @property
    def miss(self) -> float:
        return 1.0 - min(max(self.prefix_hit, 0.0), 1.0)

    @property
    def uncached(self) -> float:
        return self.prompt * self.miss

    @property
    def uncached_sq(self) -> float:
        return max(self.prompt_sq, self.prompt * self.prompt) * self.miss * self.miss


def _row_cost(cost: StepCost, load: OfferedLoad) -> float:
    return cost.per_decode_row_s + cost.per_context_token_s * (load.prompt + load.output / 2)


def _utilisation(service_s: float, ttft_s: float, residual_s: float | None = None) -> float:
    """The utilisation whose tail queue wait (Pollaczek-Khinchine: mean ``rho / (1 - rho) * residual``, times
    QUEUE_TAIL) stays within what the TTFT target leaves after a prompt's own prefill."""
    wait = max(ttft_s - service_s, MIN_WAIT_SHARE * ttft_s)
    residual = service_s if residual_s is None else residual_s
    if residual <= 0:
        return MAX_UTILISATION
    return min(MAX_UTILISATION, wait / (wait + QUEUE_TAIL * residual))


def prefill_work_s(spec: FleetSpec, load: OfferedLoad) -> float:
    """A prefill worker's mean seconds per request of the load."""
    cost, u = spec.cost, load.uncached
    steps = u / spec.chunk_tokens + 1 if spec.chunk_tokens > 0 else 1
    return (
        steps * cost.overhead_s(0, 0) + cost.per_prefill_token_s * u + cost.per_attention_pair_s * load.uncached_sq / 2
    )


def prefill_workers(spec: FleetSpec, load: OfferedLoad) -> float:
    """Prefill workers (fractional) for the load's uncached prompt tokens within the TTFT target."""
    if not spec.cost.known or load.rate <= 0:
        return 0.0
    service = prompt_steps_s(spec.cost, int(load.uncached), spec.chunk_tokens)
    if spec.transfer_tokens_per_s > 0:
        service += load.prompt / spec.transfer_tokens_per_s
    work = prefill_work_s(spec, load)
    # E[S^2] of the linear part of a prompt's work: heavy-tailed prompts wait longer
    per_token = spec.cost.per_prefill_token_s + (
        spec.cost.overhead_s(0, 0) / spec.chunk_tokens if spec.chunk_tokens > 0 else 0.0
    )
    residual = per_token * per_token * load.uncached_sq / (2 * work) if work > 0 else 0.0
    return load.rate * work / _utilisation(service, spec.ttft_s, residual)


def _kv_and_slot_cap(spec: FleetSpec, load: OfferedLoad, step_s: float) -> float:
    per_request = max(load.prompt + load.output, 1.0)
    rows = min(spec.max_running, spec.kv_tokens / per_request)
    return rows / max(load.output * step_s, 1e-9)


def decode_rate(spec: FleetSpec, load: OfferedLoad) -> float:
    """Requests/s one decode worker serves within the ITL target (0: unknown coefficients)."""
    target = spec.itl_s * ITL_HEADROOM
    cost = spec.cost
    if not cost.known or load.output <= 0 or target <= cost.base_s:
        return 0.0
    row_s = load.output * _row_cost(cost, load)
    # a fit with no decode rows in it (a prefill worker's: the only one a P+D fleet publishes when every prompt
    # is long enough to go to it) prices a row at 0: the batch slots and KV pool alone bound the rate, each step
    # taken at the ITL budget
    x = (1 - cost.base_s / target) / row_s if row_s > 0 else math.inf
    step = target
    if row_s > 0:
        # a full batch steps as long as the model prices it, at most the budget: priced at the budget, every
        # slot looked held longer than it is, and decode came out well above what the load keeps busy
        rows = min(spec.max_running, spec.kv_tokens / max(load.prompt + load.output, 1.0))
        step = min(target, cost.base_s + rows * _row_cost(cost, load))
    return min(x, _kv_and_slot_cap(spec, load, step))


def mixed_rate(spec: FleetSpec, load: OfferedLoad) -> float:
    """Requests/s one mixed worker serves within the ITL target, its prompts beside its decode batch."""
    target = spec.itl_s * ITL_HEADROOM
    cost = spec.cost
    if not cost.known or target <= cost.base_s:
        return 0.0
    own = load.uncached
    per_request = (
        load.output * _row_cost(cost, load)
        + own * cost.per_prefill_token_s
        + cost.per_attention_pair_s * load.uncached_sq / 2
    )
    x = (1 - cost.base_s / target) / max(per_request, 1e-12)
    # Its prompts run at the rate the ITL budget leaves beside the batch: the TTFT bound as for a prefill worker.
    rows = x * load.output * target
    chunk = cost.largest_chunk(target, int(rows), int(rows * (load.prompt + load.output / 2)), 0, 1 << 20, 16)
    if chunk > 0:
        service = prompt_steps_s(cost, int(own), chunk, int(rows), int(rows * (load.prompt + load.output / 2)))
        x *= _utilisation(service, spec.ttft_s) / MAX_UTILISATION
    return min(x, _kv_and_slot_cap(spec, load, target))


def _clamp(n: float, lo: int, hi: int) -> int:
    return min(max(math.ceil(n - 1e-9), lo), hi)


def size_fleet(spec: FleetSpec, load: OfferedLoad) -> Counts:
    """The replica counts serving `load` within the SLOs at the least GPU cost (prefill + decode, or mixed)."""
    lo, hi = spec.min_workers, spec.max_workers
    options: list[Counts] = []
    if "prefill" in spec.roles and "decode" in spec.roles:
        d = decode_rate(spec, load)
        n_d = load.rate / (d * MAX_UTILISATION) if d > 0 else 0.0
        options.append(
            Counts(
                _clamp(prefill_workers(spec, load), lo.prefill, hi.prefill),
                _clamp(n_d, lo.decode, hi.decode),
                lo.mixed if "mixed" in spec.roles else 0,
            )
        )
    if "mixed" in spec.roles:
        m = mixed_rate(spec, load)
        n_m = load.rate / (m * MAX_UTILISATION) if m > 0 else 0.0
        options.append(
            Counts(
                lo.prefill if "prefill" in spec.roles else 0,
                lo.decode if "decode" in spec.roles else 0,
                _clamp(n_m, lo.mixed, hi.mixed),
            )
        )
    if not options:
        raise ValueError(f"no role set to size: {spec.roles} (prefill+decode, mixed, or all three)")
    return min(options, key=lambda c: c.gpus(spec))


def _erlang_c(servers: int, offered: float) -> float:
    """The chance that a request waits in an M/M/c queue of `servers` at `offered` Erlangs (Erlang's C formula,
    through the stable recursion of his B formula)."""
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    rho = offered / servers
    return b / (1 - rho + rho * b)


def _offered_work(spec: FleetSpec, load: OfferedLoad, step_rate: float = 0.0) -> float:
    """The prefill workers `load` plus a step of `step_rate` requests/s of its lengths with no prefix hits keep
    busy (Erlangs)."""
    hitless = replace(load, prefix_hit=0.0)
    return load.rate * prefill_work_s(spec, load) + step_rate * prefill_work_s(spec, hitless)


def wait_chance(spec: FleetSpec, load: OfferedLoad, workers: int, step_rate: float = 0.0) -> float:
    """The chance that a prompt arriving finds every one of `workers` prefill workers busy (Erlang's C, as
    ``_prefill_pool``'s queue) under `load` plus a step of `step_rate` requests/s priced as the reserve prices it:
    what share of the planner's readings should show a predicted wait above 0 (every worker queued). 1 at or past
    saturation."""
    work = _offered_work(spec, load, step_rate)
    if workers <= 0 or work >= workers:
        return 1.0
    return _erlang_c(workers, work) if work > 0 else 0.0


def _prefill_pool(spec: FleetSpec, load: OfferedLoad, step_rate: float) -> int:
    """The fewest prefill workers whose shared prompt queue keeps the requests that wait past their slack within
    the share the SLO lets miss (1 - its percentile), under `load` plus `step_rate` requests/s of its lengths with
    no prefix hits. The queue is M/G/c (the router sends each prompt where it is predicted to start soonest): a
    request waits with Erlang's C chance, and then for a time about exponential with mean R / (c (1 - rho)), R the
    prompts' E[S^2] / (2 E[S]) (the linear part of a prompt's work, as ``prefill_workers``'s residual). The slack
    is what the TTFT target leaves a prompt one standard deviation longer than the mean after its own prefill: a
    queue's misses are the long prompts, which have the least of it. So a few workers of long prompts run cooler
    than many of short ones, where one utilisation for all (MAX_UTILISATION) held 8 prefill workers for a doubling
    of Mooncake's trace at 2x that needed 9-10, and 4 for a doubling of Azure's at 8x that 3 carried."""
    hitless = replace(load, prefix_hit=0.0)
    rate = load.rate + step_rate
    work = _offered_work(spec, load, step_rate)
    if work <= 0:
        return 0
    per_token = spec.cost.per_prefill_token_s + (
        spec.cost.overhead_s(0, 0) / spec.chunk_tokens if spec.chunk_tokens > 0 else 0.0
    )
    second = per_token * per_token * (load.rate * load.uncached_sq + step_rate * hitless.uncached_sq) / rate
    residual = second / (2 * work / rate)
    long = load.prompt + math.sqrt(max(load.prompt_sq - load.prompt * load.prompt, 0.0))
    service = prompt_steps_s(spec.cost, int(long), spec.chunk_tokens)
    if spec.transfer_tokens_per_s > 0:
        service += long / spec.transfer_tokens_per_s
    slack = max(spec.ttft_s - service, MIN_WAIT_SHARE * spec.ttft_s)
    allowed = 1 - spec.percentile / 100
    c = max(1, math.ceil(work - 1e-9))
    while True:
        rho = work / c
        if rho < 1 and (residual <= 0 or _erlang_c(c, work) * math.exp(-slack * c * (1 - rho) / residual) <= allowed):
            return c
        c += 1


def reserve_fleet(spec: FleetSpec, load: OfferedLoad, step_rate: float = 0.0) -> Counts:
    """The fewest prefill and decode workers that keep up with `load` plus a step of `step_rate` requests/s: what
    must already run when a load step comes, since no pod asked for then is ready before the step has done its
    harm. ``size_fleet``'s margins are for a load held for good (a tail wait at any length of time); for the
    minute or so a step lasts before new pods are up, a prompt queue whose waits stay within the long prompts'
    slack (``_prefill_pool``) and decode at its ITL-budget rate hold the targets. The step's requests have the
    load's lengths and no prefix hits: a step is new traffic (new users, sessions, a batch job) whose prompts the
    prefix caches have not seen; the hits `load` shows come from the conversations already running (priced with
    them, the reserve for a doubling of Mooncake's trace came out 10-20% short of the work it brought)."""
    rate = load.rate + step_rate
    if not spec.cost.known or rate <= 0:
        return Counts()
    d = decode_rate(spec, load)
    return Counts(
        _prefill_pool(spec, load, step_rate) if "prefill" in spec.roles else 0,
        math.ceil(rate / d - 1e-9) if "decode" in spec.roles and d > 0 else 0,
        0,
    )
