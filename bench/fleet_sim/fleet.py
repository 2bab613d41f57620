"""The fleet: simulated workers (bench/fleet_sim/worker.py) behind the router's real admission and placement
(router/decision/dispatch.py ``Dispatcher.check_ttft`` and ``route``, over a real router/decision/pool.py ``WorkerPool`` fed
the workers' loads every poll interval), sized by a controller: fixed counts, the planner (planner/core.py),
or one HPA per role on utilisation.

The router's code reads ``time.monotonic()`` (when a prompt was placed, when a load was asked for): inside a
run its modules see the simulated clock instead, so its bookkeeping of unseen placements holds in simulated
time.

Large fleets: routing over every worker costs the router's code O(workers) per request; ``route_sample`` k > 0
is the router's own ``sample_workers`` (router/decision/dispatch.py ``Dispatcher.choose_candidates``): each
request is scored on k workers of each role at random plus the k holding the longest prefix of it, the prefix
index here being the four workers that cached its first prompt block last. Only the candidates' loads are
refreshed (each at most one poll interval old) and only their prefix matches computed.

Several router processes (``router_processes`` R > 1: uvicorn workers, router pods): each is a view of its own, a
``WorkerPool`` and ``Dispatcher`` that know only the placements it made itself, and each request goes to one of
them at random (as SO_REUSEPORT spreads connections). A request's calls are held and released on the view that
placed it. Each view polls each worker every ``poll_s`` on a grid of its own, at a random phase, as events
(R x workers polls per poll interval): a snapshot is the worker's state at its poll and ages until the next.
One process refreshes a load at the first arrival a poll interval after the last instead, a snapshot as fresh
as the arrival that asks for it; R views each seeing 1/R of the arrivals would then mostly find their snapshot
due and read every other view's placements in it, hiding what R views get wrong. ``timed_polls`` gives one
process timed polls too, to compare like with like.

Workers count the prompt tokens they accepted to prefill (/load's ``prompt_tokens_accepted``) and the requests
they accepted to decode (``decodes_accepted``, counted when the router's call reaches them), from which each view
estimates the others' placements (router/decision/peers.py); ``publish_prompt_tokens_accepted`` False publishes
0 for both, which the router reads as a worker that does not count: the estimate stays 0. With one process the
count follows its placements but for a prompt a busy decode worker has yet to hand to its prefill peer (at its
next step): a poll in between can leave the router a small rate of "others" on a disaggregated fleet.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from itertools import count, islice
from operator import attrgetter
from typing import Protocol

import numpy as np

import router.decision.dispatch as router_dispatch
import router.decision.pool as router_pool
from bench.fleet_sim.device import SharedDevice, place
from bench.fleet_sim.prefix_cache import PrefixCache
from bench.fleet_sim.worker import Job, SimWorker, WorkerSpec
from bench.fleet_sim.workload import SimRequest
from common.capacity import prompt_steps_s
from common.slo import SloClasses, parse_slo_classes
from planner.observe import Totals
from planner.sizing import Counts
from router.decision.admission import AdmissionLimits
from router.decision.dispatch import Dispatcher, PromptPlan
from router.decision.policy import PolicyConfig, RouteDecision, RoutingPolicy
from router.decision.pool import Worker, WorkerPool
from router.decision.ttft_error import RELEVANT_SHARE
from router.errors import OpenAIError
from router.settings import RouterOptions

__all__ = ["Controller", "Fleet", "FleetConfig", "Result", "RouterView"]

ITL_BINS = np.logspace(-4, 1, 501)  # 0.1 ms .. 10 s
_NONE: frozenset[str] = frozenset()  # no worker excluded (the router only reads it)
_ITL_EDGES = ITL_BINS.tolist()  # the same edges for bisect (a step's numpy lookup costs more than its bisect)


class Controller(Protocol):
    interval_s: float

    def tick(self, fleet: Fleet, now: float) -> Counts | None: ...


@dataclass(frozen=True)
class FleetConfig:
    worker: WorkerSpec
    slo: SloClasses = field(default_factory=lambda: parse_slo_classes("interactive:ttft=1s,itl=50ms,p=99"))
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # 32 waiting per decode worker: the limit the simulated runs in bench/RESULTS.md were made with.
    limits: AdmissionLimits = field(default_factory=lambda: AdmissionLimits(max_waiting=32))
    admit_by_ttft: bool = True
    poll_s: float = 0.25
    route_sample: int = 0  # 0: every worker is a candidate
    startup_s: float = 60.0  # a new pod's time to ready
    net_s: float = 0.002  # router and HTTP hops a first token crosses
    # a disaggregated request's own path beyond the modelled hop and KV copy (the decode worker's call to its
    # prefill peer, the peer's intake, the KV's arrival notice): its prompt reaches the prefill worker this late
    peer_hop_s: float = 0.0
    prefix_cache_share: float = 0.5  # of a worker's KV pool that keeps finished prompts' blocks
    gpus_per_worker: int = 1
    workers_per_gpu: int = 1  # > 1: workers (any role) time-share a GPU (bench/fleet_sim/device.py), filled in order
    measure_from_s: float = 0.0  # requests arriving earlier (the fleet warming up) are left out of the figures
    seed: int = 0
    router_processes: int = 1  # router views, each blind to the others' placements but for the peers estimate
    timed_polls: bool = False  # each view polls on a grid of its own (always so with several router processes)
    # False: workers publish prompt_tokens_accepted and decodes_accepted 0 (as one that does not count): the peers
    # estimate stays 0
    publish_prompt_tokens_accepted: bool = True
    # True: each served request's first token feeds its router process's TTFT error factor
    # (router/decision/ttft_error.py), as a router's request records do; False: the factor stays 1
    error_feedback: bool = False


class _Clock:
    """Simulated time, read by the router's code as ``time.monotonic()``."""

    def __init__(self) -> None:
        self.now = 0.0
        # a bound C reader of `now` (no Python frame per read: the router reads the time a few times a request)
        self.monotonic: Callable[[], float] = partial(attrgetter("now"), self)


@dataclass(slots=True)
class RouterView:
    """One router process: its pool (fed by its own polls), its dispatcher, and when it last polled each worker."""

    pool: WorkerPool
    dispatcher: Dispatcher
    loaded_at: dict[str, float] = field(default_factory=dict)


class _Call:
    """What the router's pool holds per request (router/upstream/call.py's UpstreamCall, minus the HTTP), and the
    router process that placed it (its holds are that process's to release)."""

    __slots__ = ("process", "rid")

    def __init__(self, rid: int, process: int) -> None:
        self.rid = rid
        self.process = process

    def kill(self, reason: str) -> None:
        pass

    def prefill_back(self) -> None:
        pass


@dataclass
class Result:
    n: int
    served: int
    shed: int
    good: int
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    output_tok_per_s: float
    request_per_s: float
    gpu_hours: float
    span_s: float
    infeasible: int = 0  # requests no idle worker serves within the TTFT target (left out of the attainment)
    # measured TTFT over the TTFT predicted for the placement it was admitted on, over the served requests either
    # put at a quarter of the target or more (those the router's own error estimate counts: ttft_error.py)
    ttft_over_predicted_p50: float = math.nan
    ttft_over_predicted_p90: float = math.nan
    ttft_over_predicted_p99: float = math.nan
    ttft_over_predicted_n: int = 0
    timeline: list[dict] = field(default_factory=list)

    @property
    def attainment(self) -> float:
        """Good requests over those measured that an idle worker could serve within the targets (shed: not good)."""
        return self.good / self.n if self.n else 1.0

    def summary(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "timeline"}
        out["attainment"] = self.attainment
        return out


class Fleet:
    def __init__(self, cfg: FleetConfig, initial: Counts, controller: Controller | None = None) -> None:
        self.cfg = cfg
        self.controller = controller
        self.rng = random.Random(cfg.seed)
        self.clock = _Clock()
        # each router process's view of the simulated workers; none polls: loads are handed to it
        self.views = [self._router_view() for _ in range(max(1, cfg.router_processes))]
        self.timed_polls = cfg.timed_polls or len(self.views) > 1
        # picks each request's process and offsets the processes' polls: a stream of its own, so that one process
        # draws nothing from it and the router's own sampling sees the numbers it always did
        self.process_rng = random.Random(f"router processes {cfg.seed}")
        self.cls = cfg.slo.get("")
        self.sims: dict[str, SimWorker] = {}
        self.starting: dict[str, tuple[str, float]] = {}  # name -> (role, ready at)
        self.caches: dict[str, PrefixCache] = {}
        self._cache_tokens = int(cfg.worker.kv_tokens * cfg.prefix_cache_share)  # what a prefix cache may keep
        # first prefix block -> the workers that cached it, most recent last (a dict: ordered, whatever the hash seed)
        self.holders: dict[int, dict[str, None]] = {}
        # (time, sequence, kind, what, its detail): kind 0 a worker's wake-up (the worker, its version then), 1 work
        # given to a worker (the worker, the job), 2 a pod ready (its name), 3 a controller tick, 4 a router process's
        # timed poll (the process, the worker's name)
        self._events: list[tuple[float, int, int, object, object]] = []
        self._seq = count(1)  # ties in time go first in, first out
        self._spawned = 0
        self.live = 0  # workers holding a GPU (starting, up or draining)
        self._gpu_s = 0.0
        self._gpu_t = 0.0
        # the router's counters (planner/observe.py's Totals, built when read): the last arrival's time, and
        # requests, served, prompt tokens, prompt tokens squared, output tokens, cached tokens, shed
        self._totals_t = 0.0
        self._sums = [0.0] * 7
        self.first_token: dict[int, float] = {}
        self.itl_hist = [0.0] * (len(ITL_BINS) + 1)
        self.timeline: list[dict] = []
        self.devices: list[SharedDevice] = []  # GPUs that workers time-share
        for role in ("prefill", "decode", "mixed"):
            for _ in range(getattr(initial, role)):
                self._spawn(role, ready_at=0.0)

    def _router_view(self) -> RouterView:
        cfg = self.cfg
        pool = WorkerPool(client=None)  # type: ignore[arg-type]
        dispatcher = Dispatcher(
            pool,
            RoutingPolicy(cfg.policy),
            locator=None,  # type: ignore[arg-type]
            client=None,  # type: ignore[arg-type]
            opts=RouterOptions(admit_by_ttft=int(cfg.admit_by_ttft), sample_workers=cfg.route_sample),
            limits=cfg.limits,
            slo=cfg.slo,
            rng=self.rng,
        )
        return RouterView(pool, dispatcher)

    @property
    def totals(self) -> Totals:
        return Totals(self._totals_t, *self._sums)

    # ---- membership -----------------------------------------------------------------------------------------
    def counts(self, include_starting: bool = True) -> Counts:
        c = {"prefill": 0, "decode": 0, "mixed": 0}
        for w in self.sims.values():
            if not w.draining:
                c[w.role] += 1
        if include_starting:
            for role, _ in self.starting.values():
                c[role] += 1
        return Counts(**c)

    def _gpu_tick(self, now: float) -> None:
        self._gpu_s += self.live * (now - self._gpu_t) * self.cfg.gpus_per_worker / self.cfg.workers_per_gpu
        self._gpu_t = now

    def _spawn(self, role: str, ready_at: float) -> None:
        self._gpu_tick(self.clock.now)
        self.live += 1
        self._spawned += 1
        name = f"{role}-{self._spawned}"
        if ready_at <= self.clock.now:
            self._up(name, role)
        else:
            self.starting[name] = (role, ready_at)
            self._push(ready_at, 2, name, None)

    def _up(self, name: str, role: str) -> None:
        sim = SimWorker(name, role, self.cfg.worker, self._on_first_token, self._on_finish, self._record_itl)
        sim.itl_slo_s = self.cls.itl_s
        sim.publishes_accepted = self.cfg.publish_prompt_tokens_accepted
        if self.cfg.workers_per_gpu > 1:
            sim.device = place(self.devices, sim, self.cfg.workers_per_gpu, self._moved, self.cfg.worker.share_slice_s)
            for other in sim.device.members[:-1]:
                # a worker alone on its GPU steps as on its own (decode stretches): its stretch ends at the next
                # step, the steps after it share the GPU (the step in flight finishes as it was)
                self._wake_at(other, other.cut_span(self.clock.now))
        self.sims[name] = sim
        self.caches[name] = PrefixCache()
        for view in self.views:
            view.pool.add(name, role)
        self._report(name)
        if self.timed_polls:
            # every process sees it come up; their polls then run at phases of their own
            poll_s = self.cfg.poll_s
            for i in range(len(self.views)):
                self._push(self.clock.now + poll_s * (1.0 - self.process_rng.random()), 4, i, name)

    def _report(self, name: str) -> None:
        """Every router process reads `name`'s load now (it came up or began to drain)."""
        now = self.clock.now
        load = self.sims[name].load(now)
        for view in self.views:
            view.pool.report_load(view.pool.workers[name], load, asked=now)
            view.loaded_at[name] = now

    def _poll(self, process: int, name: str) -> None:
        """Router process `process`'s timed poll of `name`, and its next one a poll interval on (none once the
        worker has left)."""
        view, sim = self.views[process], self.sims.get(name)
        w = view.pool.workers.get(name)
        if w is None or sim is None:
            return
        now = self.clock.now
        view.pool.report_load(w, sim.load(now), asked=now)
        view.loaded_at[name] = now
        self._push(now + self.cfg.poll_s, 4, process, name)

    def scale_to(self, targets: Counts) -> None:
        have = self.counts()
        for role in ("prefill", "decode", "mixed"):
            diff = getattr(targets, role) - getattr(have, role)
            for _ in range(diff):
                self._spawn(role, self.clock.now + self.cfg.startup_s)
            if diff < 0:
                self._drain(role, -diff)

    def _drain(self, role: str, n: int) -> None:
        """Cancels pods still starting first, then drains the least loaded: the router stops placing there and
        the pod leaves once what it runs is done (its SIGTERM path)."""
        for name in [k for k, (r, _) in self.starting.items() if r == role][:n]:
            del self.starting[name]
            self._gpu_tick(self.clock.now)
            self.live -= 1
            n -= 1
        up = sorted(
            (w for w in self.sims.values() if w.role == role and not w.draining),
            key=lambda w: w.n_rows + len(w.waiting),
        )
        for w in up[:n]:
            w.draining = True
            self._report(w.name)
            self._maybe_leave(w)

    def _maybe_leave(self, w: SimWorker) -> None:
        if w.draining and w.idle() and w.name in self.sims:
            self._gpu_tick(self.clock.now)
            self.live -= 1
            del self.sims[w.name]
            if w.device is not None:
                w.device.members.remove(w)
            for view in self.views:
                rw = view.pool.workers.get(w.name)
                if rw is not None:
                    view.pool.remove(rw)
            self.caches.pop(w.name, None)

    # ---- events -------------------------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, what: object, detail: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, what, detail))

    def _wake_at(self, w: SimWorker, t: float | None) -> None:
        if t is not None:
            self._push(t, 0, w, w.version)

    def _moved(self, w: SimWorker, device_end: float) -> None:
        self._wake_at(w, w.retime(device_end))

    def _give(self, w: SimWorker, job: Job) -> None:
        now = self.clock.now
        t = w.wake(now) if w.add(job, now) else w.cut_span(now, job)
        if t is not None:  # _wake_at, in line: about two a request
            heapq.heappush(self._events, (t, next(self._seq), 0, w, w.version))

    def run(self, requests: list[SimRequest], until: float | None = None) -> Result:
        saved = router_pool.time, router_dispatch.time
        router_pool.time = router_dispatch.time = self.clock  # type: ignore[assignment]
        # Reference counts free what a run drops (the collector finds a few hundred objects left in cycles by a
        # planner's ticks over 200 s), so its passes over the fleet's objects are wasted: off for the run (about
        # 5% of a large fleet's time), the few cycles collected after it.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run(requests, until)
        finally:
            router_pool.time, router_dispatch.time = saved
            if collecting:
                gc.enable()

    def _run(self, requests: list[SimRequest], until: float | None) -> Result:
        n = len(requests)
        # per request, as lists while the run writes them one at a time (a numpy element costs several times more)
        # and as arrays once it is done
        self.ttft: list[float] | np.ndarray = [math.nan] * n
        self.good: list[bool] | np.ndarray = [False] * n
        self.shed_mask: list[bool] | np.ndarray = [False] * n
        self.predicted: list[float] | np.ndarray = [math.nan] * n  # the TTFT its placement was admitted on
        self.out_tokens = 0
        end = until if until is not None else (requests[-1].t if requests else 0.0)
        if self.controller is not None:
            self._push(0.0, 3, None, None)
        i = 0
        events, seq = self._events, self._seq
        clock = self.clock
        pop, push = heapq.heappop, heapq.heappush
        t_arr = requests[0].t if n else math.inf
        while True:
            if events and events[0][0] <= t_arr:
                t, _, kind, what, detail = pop(events)
                if t > end and kind >= 3:  # no controller ticks nor polls past the run's end: it drains
                    continue
                clock.now = t
                if kind == 0:
                    w = what  # type: ignore[assignment]
                    if w.version == detail:
                        woken = w.wake(t)
                        if woken is not None:  # _wake_at, in line: the loop's most frequent event
                            push(events, (woken, next(seq), 0, w, w.version))
                        if w.notices or w.notices_held:
                            self._land_notices(w, t, woken is None)
                        if w.asks:
                            self._ask_peers(w)
                        if w.draining:
                            self._maybe_leave(w)
                elif kind == 1:
                    w = what  # type: ignore[assignment]
                    if w.name in self.sims:
                        self._give(w, detail)  # type: ignore[arg-type]
                elif kind == 2:
                    if what in self.starting:
                        role, _ = self.starting.pop(what)  # type: ignore[arg-type]
                        self._up(what, role)  # type: ignore[arg-type]
                elif kind == 3:
                    self._tick(t)
                elif kind == 4:
                    self._poll(what, detail)  # type: ignore[arg-type]
            elif i < n:
                clock.now = t_arr
                self._arrive(i, requests[i])
                i += 1
                t_arr = requests[i].t if i < n else math.inf
            else:
                break
        self._gpu_tick(max(self.clock.now, end))
        return self._result(requests, max(self.clock.now, end))

    def _tick(self, now: float) -> None:
        assert self.controller is not None
        targets = self.controller.tick(self, now)
        if targets is not None:
            self.scale_to(targets)
        self._push(now + self.controller.interval_s, 3, None, None)

    # ---- a request ----------------------------------------------------------------------------------------------
    def _candidates(self, req: SimRequest, plan: PromptPlan, view: RouterView) -> None:
        """Gives `plan` its prefix matches and its candidates fresh loads (each at most one poll interval old;
        timed polls keep them so already): every worker, or with ``route_sample`` those the router samples, told
        the prompt's prefix holders."""
        cfg = self.cfg
        now = self.clock.now
        pool = view.pool
        workers: Iterable[Worker]
        if cfg.route_sample:
            if req.blocks:
                # the four that cached it last (the likeliest to hold it still)
                recent = islice(reversed(self.holders.get(req.blocks[0], {})), 4)
                plan.matches = self._matches(req, [h for h in recent if h in pool.workers])
            view.dispatcher.choose_candidates(plan)
            workers = plan.candidates or []
            # the holders' matches are known already (the longest to compute: they run far into the prompt)
            plan.matches = self._matches(req, [w.url for w in workers], plan.matches)
        else:
            workers = pool.workers.values()
            plan.matches = self._matches(req, pool.workers)
        if self.timed_polls:
            return
        loaded_at, poll_s, sims = view.loaded_at, cfg.poll_s, self.sims
        for w in workers:
            if now - loaded_at.get(w.url, -1e9) >= poll_s:  # _report, with the router's worker at hand
                pool.report_load(w, sims[w.url].load(now), asked=now)
                loaded_at[w.url] = now

    def _matches(self, req: SimRequest, names: Iterable[str], known: dict[str, int] | None = None) -> dict[str, int]:
        """What the prefix index says of `names`: the pages of the prompt's leading blocks each holds (those in
        `known` as it says: computed for this request already)."""
        if not req.blocks:
            return {}
        out = {}
        caches, blocks = self.caches, req.blocks
        for name in names:
            if known and name in known:
                out[name] = known[name]
                continue
            cache = caches.get(name)
            if not cache:
                continue
            k = 0
            for b in blocks:
                if b not in cache:
                    break
                k += 1
            if k:
                out[name] = min(req.prompt, k * req.block_tokens) // self.cfg.worker.page_size
        return out

    def _cache(self, name: str, req: SimRequest) -> None:
        cache = self.caches.get(name)
        if cache is None or not req.blocks:
            return
        cache.touch(req.blocks, self._cache_tokens // req.block_tokens)
        held = self.holders.get(req.blocks[0])
        if held is None:
            held = self.holders[req.blocks[0]] = {}
        else:
            held.pop(name, None)
        held[name] = None

    def _arrive(self, rid: int, req: SimRequest) -> None:
        cfg = self.cfg
        now = self.clock.now
        sums = self._sums
        self._totals_t = now
        sums[0] += 1
        # positional (token ids, block hashes, matches, block size, record, request tokens, SLO class): a keyword
        # costs the dataclass's __init__ more than the rest of it
        plan = PromptPlan(_tokens(req.prompt), [], {}, cfg.worker.page_size, None, 0, self.cls)
        views = self.views
        process = int(self.process_rng.random() * len(views)) if len(views) > 1 else 0
        view = views[process]
        self._candidates(req, plan, view)
        try:
            view.dispatcher.check_ttft(plan, self.cls)
            decision = view.dispatcher.route(plan, req.output, _NONE, _NONE)  # type: ignore[arg-type]
        except OpenAIError:
            self.shed_mask[rid] = True
            sums[6] += 1
            return
        workers = view.pool.workers
        self.predicted[rid] = _admitted_prediction(plan, workers, decision)
        d = self.sims[decision.decode]
        d.decodes_accepted += 1
        call = _Call(rid, process)
        rd = workers[decision.decode]
        rd.hold_decode(call, now, req.prompt + req.output)
        if decision.prefill is not None:
            p = self.sims[decision.prefill]
            matched = decision.prefill_matched_tokens
            workers[decision.prefill].hold_prefill(call, now, req.prompt - matched)
            job = Job(rid, req.t, req.prompt, max(1, req.prompt - matched), 0, req.prompt)
            job.peer = (d, req)
            hop = self.cfg.peer_hop_s
            if d.busy_until < 0:
                if hop > 0:
                    self._push(now + hop, 1, p, job)
                else:
                    self._give(p, job)  # an idle engine takes it in at once
            elif d.span_shared:
                d.asks.append((p, job))  # its step's end moves with what else runs on its GPU: asked at its wake
            else:
                self._push(d.next_boundary(now) + hop, 1, p, job)  # its steps are unchanged by it: not cut
            self._cache(p.name, req)
        else:
            matched = decision.decode_matched_tokens
            job = Job(rid, req.t, req.prompt, max(1, req.prompt - matched), req.output, req.prompt + req.output)
            self._give(d, job)
        self._cache(d.name, req)
        job.call = call
        sums[1] += 1
        sums[2] += req.prompt
        sums[3] += req.prompt * req.prompt
        sums[4] += req.output
        sums[5] += matched

    def _ask_peers(self, d: SimWorker) -> None:
        """`d`'s loop turn: the prompts it reserved pages for go to their prefill workers."""
        asks, d.asks = d.asks, []
        hop = self.cfg.peer_hop_s
        for p, job in asks:
            if hop > 0:
                self._push(self.clock.now + hop, 1, p, job)  # given then, if the peer is still there
            elif p.name in self.sims:  # type: ignore[attr-defined]
                self._give(p, job)  # type: ignore[arg-type]

    def _on_first_token(self, w: SimWorker, job: Job, now: float) -> None:
        if job.peer is not None:  # a prefill for a peer: its KV moves, then it decodes there
            if w.spec.notice_after_step and w.span_shared:
                w.notices.append((job, now))  # lands at the end of the step in flight (_land_notices)
                return
            self._kv_moves(w, job, now, now)
            return
        self.ttft[job.rid] = now - job.arrival + self.cfg.net_s
        if self.cfg.error_feedback:
            self._feed_error(job)

    def _land_notices(self, w: SimWorker, now: float, idle: bool) -> None:
        """`w`'s step ended at `now`: the KV of the first tokens it held lands, and so does that of those the step
        just gave when no step of its runs on (`idle`); the rest wait for the step now in flight."""
        held, w.notices_held = w.notices_held, []
        if idle:
            held += w.notices
        else:
            w.notices_held = w.notices
        w.notices = []
        for job, first in held:
            self._kv_moves(w, job, first, now)

    def _kv_moves(self, w: SimWorker, job: Job, first: float, now: float) -> None:
        """A prompt prefilled on `w` for a peer, its first token at `first`: its KV moves from `now` on, then the
        rest decodes there."""
        d, req = job.peer  # type: ignore[misc]
        call = job.call
        rw = self.views[call.process].pool.workers.get(w.name)  # type: ignore[attr-defined]
        if rw is not None:
            rw.release_prefill(call)
        arrive = now + self.cfg.worker.transfer_s(req.prompt, w.device is not None and w.device is d.device)
        self.ttft[job.rid] = arrive - job.arrival + self.cfg.net_s
        if self.cfg.error_feedback and req.output <= 1:
            self._feed_error(job)  # one with more to decode feeds it once, at its first token there
        if req.output > 1:
            dj = Job(job.rid, job.arrival, req.prompt, 0, req.output - 1, req.prompt + req.output)
            dj.call = call
            heapq.heappush(self._events, (arrive, next(self._seq), 1, d, dj))  # _push, in line: one a request
        else:
            self._on_finish(d, job, first, 0.0)
        if w.draining:
            self._maybe_leave(w)

    def _feed_error(self, job: Job) -> None:
        """The router process that placed `job` sees its first token: measured against predicted TTFT."""
        predicted, ttft = self.predicted[job.rid], self.ttft[job.rid]
        if math.isfinite(predicted):
            error = self.views[job.call.process].dispatcher.ttft_error  # type: ignore[attr-defined]
            error.observe(job.arrival + ttft, ttft, predicted, self.cls.ttft_s)

    def _on_finish(self, w: SimWorker, job: Job, now: float, slow: float) -> None:
        rw = self.views[job.call.process].pool.workers.get(w.name)  # type: ignore[attr-defined]
        if rw is not None:
            rw.release_decode(job.call)  # type: ignore[arg-type]
        cls = self.cls
        self.good[job.rid] = (
            cls.ttft_s is None or self.ttft[job.rid] <= cls.ttft_s
        ) and slow <= 1 - cls.percentile / 100

    def _record_itl(self, step_s: float, tokens: float) -> None:
        self.itl_hist[bisect_left(_ITL_EDGES, step_s)] += tokens
        self.out_tokens += tokens

    # ---- results --------------------------------------------------------------------------------------------------
    def _itl_pct(self, q: float) -> float:
        c = np.cumsum(self.itl_hist)
        if c[-1] <= 0:
            return 0.0
        i = int(np.searchsorted(c, q / 100 * c[-1]))
        return float(ITL_BINS[min(i, len(ITL_BINS) - 1)])

    def _feasible(self, requests: list[SimRequest]) -> np.ndarray:
        """Whether each request's own prefill (alone on an idle worker, its KV moved) fits the TTFT target."""
        spec, ttft = self.cfg.worker, self.cls.ttft_s
        if ttft is None:
            return np.ones(len(requests), dtype=bool)
        local = self.cfg.workers_per_gpu > 1
        alone = {
            p: prompt_steps_s(spec.cost, p, spec.max_prefill_tokens) + spec.transfer_s(p, local) + self.cfg.net_s
            for p in {r.prompt for r in requests}
        }
        return np.array([alone[r.prompt] <= ttft for r in requests], dtype=bool)

    def _result(self, requests: list[SimRequest], end: float) -> Result:
        self.ttft = np.array(self.ttft, dtype=float)
        self.good = np.array(self.good, dtype=bool)
        self.shed_mask = np.array(self.shed_mask, dtype=bool)
        self.predicted = np.array(self.predicted, dtype=float)
        measured = np.array([r.t >= self.cfg.measure_from_s for r in requests], dtype=bool)
        feasible = self._feasible(requests)
        counted = measured & feasible
        served = ~np.isnan(self.ttft) & measured
        t = self.ttft[served]
        ratios = self._prediction_ratios(served)
        span = max(end, 1e-9)
        return Result(
            n=int(counted.sum()),
            served=int(served.sum()),
            shed=int((self.shed_mask & measured).sum()),
            good=int((self.good & counted).sum()),
            infeasible=int((measured & ~feasible).sum()),
            ttft_p50_s=float(np.percentile(t, 50)) if t.size else math.nan,
            ttft_p99_s=float(np.percentile(t, 99)) if t.size else math.nan,
            itl_p50_s=self._itl_pct(50),
            itl_p99_s=self._itl_pct(99),
            output_tok_per_s=sum(r.output for r, ok in zip(requests, served) if ok) / span,
            request_per_s=int(served.sum()) / span,
            gpu_hours=self._gpu_s / 3600,
            span_s=span,
            ttft_over_predicted_p50=_quantile(ratios, 50),
            ttft_over_predicted_p90=_quantile(ratios, 90),
            ttft_over_predicted_p99=_quantile(ratios, 99),
            ttft_over_predicted_n=int(ratios.size),
            timeline=self.timeline,
        )

    def _prediction_ratios(self, served: np.ndarray) -> np.ndarray:
        """Measured over predicted TTFT of the `served` requests whose prediction or measurement reached a
        quarter of the target (those the router's own error estimate counts: router/decision/ttft_error.py). The
        measured TTFT is the router's, its hops included, as a router process measures it."""
        predicted = self.predicted
        ok = served & (predicted > 0)
        target = self.cls.ttft_s
        if target is not None:
            ok &= np.maximum(self.ttft, predicted) >= RELEVANT_SHARE * target
        return self.ttft[ok] / predicted[ok]


def _admitted_prediction(plan: PromptPlan, workers: dict[str, Worker], decision: RouteDecision) -> float:
    """The predicted TTFT of the placement `decision` made: what `Dispatcher.route` scored the chosen worker on,
    read back from the plan's predictions (route fills them for every open candidate). Not predicted anew: the
    placement has joined the worker's unseen prompts since, and a new prediction would queue the prompt behind
    itself."""
    remote = decision.prefill is not None
    w = workers.get(decision.prefill if remote else decision.decode)  # type: ignore[arg-type]
    predicted = plan.placed_prediction(w, remote)[0] if w is not None else None
    return predicted if predicted is not None else math.nan


def _quantile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def _tokens(n: int) -> list[int]:
    """A prompt of `n` tokens: the router's code here reads only its length (no prefix lookup runs), so a range
    stands in for the token list without building one."""
    return range(n)  # type: ignore[return-value]
