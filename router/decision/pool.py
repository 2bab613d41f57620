"""The router's registry of workers: who they are, whether they answer, how loaded they are (busy is not dead:
docs/reliability.md, "How the router tells busy from dead")."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.decision.load import ROLES, Load, parse_load
from router.decision.peers import PeerPlacements
from router.decision.policy import DecodeCandidate, PrefillCandidate
from router.decision.ttft_model import WorkerFigures
from router.settings import RouterOptions
from router.wire import ConnectError, WireClient

log = logging.getLogger("kvferry.router")

__all__ = ["HeldCounts", "Watched", "Worker", "WorkerPool"]

DECODE_ROLES = frozenset({"decode", "mixed"})  # take /internal/generate
PREFILL_ROLES = frozenset({"prefill", "mixed"})  # take /internal/prefill for a peer's pages
# A call sent up to this long before a poll may not have reached the worker when it answered.
RECONCILE_GRACE_S = 1.0
# /load is the engine's last snapshot (ten a second): a prompt placed this long before the poll may be missing.
SNAPSHOT_LAG_S = 0.2
# Other processes' likely placements grow with the snapshot's age: the figures are rebuilt this often meanwhile.
PEER_TICK_S = 0.02


class Watched(Protocol):
    def kill(self, reason: str) -> None: ...

    def prefill_back(self) -> None: ...


@dataclass(slots=True)  # built on each change of a worker's calls: a frozen one's __init__ costs ~3x
class HeldCounts:
    load: Load | None
    asked: float
    revision: int
    decoding: int  # calls of each kind: a dict changed outside hold/release shows here
    prefilling: int
    inflight_requests: int
    unseen_kv_tokens: int
    inflight_tokens: int


@dataclass(slots=True)
class _CallSums:
    """What a worker's holding calls add up to against one snapshot's poll time (`since`: sent at or after it
    is recent), kept up by each hold and release so a read costs O(1), not O(calls). Calls held in time order
    (the router's clock only moves on) have their recent ones last: a new poll recounts only those."""

    since: float
    decoding: int  # the calls the sums cover: a dict changed outside hold/release no longer matches
    prefilling: int
    recent: int  # calls sent since `since`, which the worker's snapshot may not count yet
    unseen_kv: int  # KV tokens of the recent decode calls
    prompt_tokens: int  # prompt tokens of the prefill calls
    newest_decode: float = -math.inf  # the latest time a call of each kind was held
    newest_prefill: float = -math.inf
    in_order: bool = True  # each call held no earlier than those before it in its dict

    @classmethod
    def of(cls, w: Worker, since: float) -> _CallSums:
        s = cls(since, len(w.decoding), len(w.prefilling), 0, 0, 0)
        kv = w.kv_tokens
        for call, t in w.decoding.items():
            s.decoded(t)
            if t >= since:
                s.recent += 1
                s.unseen_kv += kv.get(call, 0)
        for t, n in w.prefilling.values():
            s.prefilled(t)
            s.prompt_tokens += n
            s.recent += t >= since
        return s

    def decoded(self, t: float) -> None:
        if t < self.newest_decode:
            self.in_order = False
        else:
            self.newest_decode = t

    def prefilled(self, t: float) -> None:
        if t < self.newest_prefill:
            self.in_order = False
        else:
            self.newest_prefill = t

    def rebase(self, w: Worker, since: float) -> bool:
        """Recounts the recent calls against a new poll's `since` from each dict's newest end; False when the
        calls were not held in time order (then only a full count is right)."""
        if not self.in_order:
            return False
        recent = unseen_kv = 0
        kv = w.kv_tokens
        for call, t in reversed(w.decoding.items()):
            if t < since:
                break
            recent += 1
            unseen_kv += kv.get(call, 0)
        for t, _ in reversed(w.prefilling.values()):
            if t < since:
                break
            recent += 1
        self.since, self.recent, self.unseen_kv = since, recent, unseen_kv
        return True


@dataclass(eq=False, slots=True)  # read per candidate per request: slot access is the quickest
class Worker:
    url: str
    role: str
    pod: str | None = None
    load: Load | None = None
    up: bool = False
    stale: bool = False  # its last poll failed: routed on its last known load until it answers again
    failures: int = 0  # polls failed in a row
    last_ok: float = 0.0  # monotonic time of the last good poll
    last_seen: float = 0.0  # ... or of the last event read from one of its streams (set by router/upstream/call.py)
    last_error: str = ""
    # The calls holding this worker now, with the time each was sent: decode calls until closed, prefill calls
    # until their first token. Counts derive from these (router/upstream/call.py removes them on every ending).
    decoding: dict[Watched, float] = field(default_factory=dict)
    kv_tokens: dict[Watched, int] = field(
        default_factory=dict
    )  # the KV each decode call reserves (prompt + max_tokens)
    prefilling: dict[Watched, tuple[float, int]] = field(default_factory=dict)
    load_asked: float = 0.0  # monotonic time the poll that brought ``load`` was sent
    placed: list[tuple[float, int]] = field(default_factory=list)
    # Running totals of the prompt tokens this process placed here, all and uncached: against the worker's own
    # count they show what other router processes placed (peers.py).
    placed_prompt_tokens: int = 0
    placed_uncached_tokens: int = 0
    placed_prompts: int = 0
    peers: PeerPlacements = field(default_factory=PeerPlacements)
    # The same for decode calls: a running total, the recent ones' send times, and the others' rate of them.
    placed_decodes: int = 0
    recent_decodes: deque[float] = field(default_factory=deque)
    decode_peers: PeerPlacements = field(default_factory=PeerPlacements)
    placed_revision: int = 0  # bumped whenever `placed` changes: a TTFT input cached per snapshot reads it
    holds_revision: int = 0  # bumped by every hold and release: what the calls add up to is cached against it
    _held: HeldCounts | None = field(default=None, init=False, repr=False)
    _sums: _CallSums | None = field(default=None, init=False, repr=False)
    # (load, when asked, placement revision, peers' tick) the TTFT figures were built from, and the figures
    _figures: tuple[Load, float, int, int, WorkerFigures] | None = field(default=None, init=False, repr=False)
    task: asyncio.Task[None] | None = None
    removed: bool = False

    @property
    def watchers(self) -> list[Watched]:
        return [*self.decoding, *self.prefilling]

    def hold_decode(self, call: Watched, now: float, kv_tokens: int = 0) -> None:
        s = self._sums_in_step()
        if call in self.decoding:
            s = self._sums = None
        else:
            self._placed_decode(now)
        self.decoding[call] = now
        self.kv_tokens[call] = kv_tokens
        self.holds_revision += 1
        if s is not None:
            s.decoding += 1
            s.decoded(now)
            if now >= s.since:
                s.recent += 1
                s.unseen_kv += kv_tokens

    def hold_prefill(self, call: Watched, now: float, prompt_tokens: int) -> None:
        s = self._sums_in_step()
        if call in self.prefilling:
            s = self._sums = None
        self.prefilling[call] = (now, prompt_tokens)
        self.holds_revision += 1
        if s is not None:
            s.prefilling += 1
            s.prefilled(now)
            s.prompt_tokens += prompt_tokens
            s.recent += now >= s.since

    def release_prefill(self, call: Watched) -> None:
        s = self._sums_in_step()
        held = self.prefilling.pop(call, None)
        self.holds_revision += 1
        if s is not None and held is not None:
            s.prefilling -= 1
            s.prompt_tokens -= held[1]
            s.recent -= held[0] >= s.since

    def release_decode(self, call: Watched) -> None:
        s = self._sums_in_step()
        t = self.decoding.pop(call, None)
        kv = self.kv_tokens.pop(call, None)
        self.holds_revision += 1
        if s is not None and t is not None:
            s.decoding -= 1
            if t >= s.since:
                s.recent -= 1
                s.unseen_kv -= kv or 0

    def _sums_in_step(self) -> _CallSums | None:
        """The running sums when they still match the calls (a dict changed outside hold/release: None)."""
        s = self._sums
        if s is None or s.decoding != len(self.decoding) or s.prefilling != len(self.prefilling):
            self._sums = None
            return None
        return s

    def streamed(self, now: float) -> None:
        self.last_seen = now

    def refused_not_ready(self) -> None:
        self.up = False

    @property
    def inflight_requests(self) -> int:
        """The requests this router has open here, corrected by the worker's `live_requests` at each poll."""
        return self.held().inflight_requests

    @property
    def unseen_kv_tokens(self) -> int:
        """KV tokens of decode calls sent here after its last snapshot's poll (less the grace)."""
        return self.held().unseen_kv_tokens

    def held(self) -> HeldCounts:
        """The holding calls' sums against the last snapshot, cached per change (read several times a request)."""
        h = self._held
        if (
            h is not None
            and h.load is self.load
            and h.asked == self.load_asked
            and h.revision == self.holds_revision
            and h.decoding == len(self.decoding)
            and h.prefilling == len(self.prefilling)
        ):
            return h
        since = self.load_asked - RECONCILE_GRACE_S
        s = self._sums_in_step()
        if s is None or (s.since != since and not s.rebase(self, since)):
            s = self._sums = _CallSums.of(self, since)
        mine = s.decoding + s.prefilling
        load = self.load
        inflight = mine if load is None or load.live_requests is None else min(mine, load.live_requests + s.recent)
        self._held = h = HeldCounts(
            load,
            self.load_asked,
            self.holds_revision,
            s.decoding,
            s.prefilling,
            inflight,
            s.unseen_kv,
            s.prompt_tokens,
        )
        return h

    def place_prompt(self, now: float, tokens: int, prompt_tokens: int) -> Callable[[], None]:
        """This router placed a prompt here to prefill, `tokens` of its `prompt_tokens` uncached; the returned
        call forgets it once its first token is back."""
        self.placed_prompt_tokens += prompt_tokens
        self.placed_uncached_tokens += tokens
        self.placed_prompts += 1
        since = self.load_asked - SNAPSHOT_LAG_S
        self.placed = [e for e in self.placed if e[0] >= since]
        entry = (now, tokens)
        self.placed.append(entry)
        self.placed_revision += 1

        def prefilled() -> None:
            self.placed = [e for e in self.placed if e is not entry]
            self.placed_revision += 1

        return prefilled

    def figures(self) -> WorkerFigures:
        """Its TTFT inputs (router/decision/ttft_model.py), built once per load snapshot, placement and, while
        other processes place here, `PEER_TICK_S` (a prediction is then O(1)); needs a load."""
        load = self.load
        assert load is not None
        now = time.monotonic()
        tick = int(now / PEER_TICK_S) if self.peers.rate > 0 else 0
        hit = self._figures
        if (
            hit is not None
            and hit[0] is load
            and hit[1] == self.load_asked
            and hit[2] == self.placed_revision
            and hit[3] == tick
        ):
            return hit[4]
        figures = WorkerFigures.from_load(load, self.unseen_prompt_tokens(now))
        self._figures = (load, self.load_asked, self.placed_revision, tick, figures)
        return figures

    def unseen_prompt_tokens(self, now: float) -> int:
        """Prompt tokens placed here that the last snapshot may not count yet (the TTFT prediction adds them):
        this process's own, and what the others likely placed meanwhile. The others' age keeps the snapshot-lag
        allowance their mean rate does not need: that rate is an average, and what matters is the queue a request
        meets when their placements bunch (Poisson arrivals; several processes picking the same emptiest worker).
        In the simulator (bench/fleet_sim/router_processes.py, RESULTS.md) the allowance put two and four
        processes' measured / predicted TTFT p99 at 0.91-1.08 on one worker (one process: 0.81-1.02; without
        the allowance 1.13-1.66), and four processes on four workers past saturation at 56 good requests/s
        against 49-50 without it."""
        since = self.load_asked - SNAPSHOT_LAG_S
        mine = sum([n for t, n in self.placed if t >= since])  # a list: no generator to start for a few entries
        return mine + self.peers.placed_since(now - since)

    def _placed_decode(self, now: float) -> None:
        self.placed_decodes += 1
        recent = self.recent_decodes
        since = self.load_asked - SNAPSHOT_LAG_S
        while recent and recent[0] < since:
            recent.popleft()
        recent.append(now)

    def unseen_decodes(self, now: float) -> int:
        """Decode calls placed here since the last snapshot while other router processes place here too: this
        process's own, and the others' likely ones (their rate from the worker's `decodes_accepted`). The decode
        pick adds them to the snapshot's waiting requests. Its own calls (`inflight_requests`) count all a lone
        process placed, but with others they are only a share of the worker's, so the snapshot's count decided,
        and every process sent what came between two polls to the worker that snapshot showed emptiest.
        In the simulator (bench/RESULTS.md, "Several router processes in the simulator" and "Disaggregated decode
        pods count the others' calls"): four agg workers at 0.85x saturation, TTFT p99 0.71-0.72 s with two or four
        processes against 0.46-0.54 s counting these (one process 0.46 s); four prefill and four decode pods, with
        these and the others' tokens in the prefill pick's queue (`unseen_prompt_tokens`), TTFT p99 at saturation
        0.81-0.95 -> 0.74-0.80 s and 1.5-2.6 more good requests/s past it."""
        since = self.load_asked - SNAPSHOT_LAG_S
        others = self.decode_peers.placed_since(now - since)
        if not others:
            return 0  # no other process places here: this one's calls (`inflight_requests`) count all it placed
        mine = 0
        for t in reversed(self.recent_decodes):  # in time order: the recent ones last
            if t < since:
                break
            mine += 1
        return others + mine

    @property
    def inflight_tokens(self) -> int:
        return self.held().inflight_tokens

    def prefill_candidate(
        self, predicted_ttft_s: float | None = None, held: HeldCounts | None = None
    ) -> PrefillCandidate:
        """Its policy inputs; `held`: `self.held()` where the caller has it."""
        load = self.load
        held = held or self.held()
        if load is None:
            return PrefillCandidate(
                key=self.url,
                pod=self.pod,
                inflight_tokens=held.inflight_tokens,
                inflight_requests=held.inflight_requests,
                predicted_ttft_s=predicted_ttft_s,
            )
        # positional: built per candidate per request, where keywords cost a dataclass __init__ ~2x
        return PrefillCandidate(
            self.url,  # key
            self.pod,  # pod
            # where other router processes place here too, what was placed since the snapshot (a lone process's
            # calls, `inflight_tokens`, count all it placed)
            load.queued_prefill_tokens + (self.unseen_prompt_tokens(time.monotonic()) if self.peers.rate else 0),
            held.inflight_tokens,  # inflight_tokens
            held.inflight_requests,  # inflight_requests
            load.prefill_tokens_per_s,  # prefill_tokens_per_s
            self.role == "mixed" and load.running_requests > 0,  # decoding
            load.prefill_chunk_tokens,  # prefill_chunk_tokens
            load.prefill_step_tokens_per_s,  # prefill_step_tokens_per_s
            load.decode_step_s,  # decode_step_s
            predicted_ttft_s,  # predicted_ttft_s
            load.step_cost,  # step_cost
            load.decode_rows,  # decode_rows
            load.decode_context,  # decode_context
        )

    def decode_candidate(
        self, predicted_ttft_s: float | None = None, held: HeldCounts | None = None
    ) -> DecodeCandidate:
        """Its policy inputs; `held`: `self.held()` where the caller has it."""
        load = self.load
        inflight = (held or self.held()).inflight_requests
        if load is None:
            return DecodeCandidate(
                key=self.url, pod=self.pod, inflight_requests=inflight, predicted_ttft_s=predicted_ttft_s
            )
        # positional, as in prefill_candidate
        return DecodeCandidate(
            self.url,  # key
            self.pod,  # pod
            load.running_requests,  # running
            # waiting, and placed since the snapshot where other router processes place here too
            load.waiting_requests + (self.unseen_decodes(time.monotonic()) if self.decode_peers.rate else 0),
            inflight,  # inflight_requests
            load.free_pages,  # free_pages
            load.total_pages,  # total_pages
            load.page_size,  # page_size
            load.queued_prefill_tokens,  # queued_tokens
            load.prefill_tokens_per_s,  # prefill_tokens_per_s
            load.prefill_chunk_tokens,  # prefill_chunk_tokens
            load.prefill_step_tokens_per_s,  # prefill_step_tokens_per_s
            load.decode_step_s,  # decode_step_s
            predicted_ttft_s,  # predicted_ttft_s
            load.step_cost,  # step_cost
            load.decode_rows,  # decode_rows
            load.decode_context,  # decode_context
        )


class WorkerPool:
    def __init__(
        self,
        client: WireClient,
        opts: RouterOptions | None = None,
    ) -> None:
        opts = opts if opts is not None else RouterOptions()
        self.client = client
        self.poll_interval_s = opts.poll_interval_s
        self.poll_timeout_s = opts.poll_timeout_s
        self.down_after_failures = max(1, opts.down_after_failures)
        self.down_after_s = opts.down_after_s
        self.workers: dict[str, Worker] = {}
        self._targets: dict[str, set[str]] = {role: set() for role in ROLES}
        self._started = False
        self._by_pod: dict[str, Worker] = {}  # the pod each worker's last snapshot named
        self._members: dict[frozenset[str], list[Worker]] = {}  # roles -> their workers (cleared on a change)

    def set_targets(self, role: str, urls: set[str] | list[str]) -> None:
        """Makes ``urls`` the ``role`` workers: new ones polled at once, missing ones dropped from routing."""
        wanted = {u.rstrip("/") for u in urls}
        self._targets[role] = wanted
        for url in wanted:
            w = self.workers.get(url)
            if w is None or w.role != role:
                if w is not None:
                    self.remove(w)
                self.add(url, role)
        for url, w in list(self.workers.items()):
            if w.role == role and url not in wanted:
                self.remove(w)

    def add(self, url: str, role: str) -> Worker:
        """A new worker at `url`, polled from now on when the pool runs."""
        w = Worker(url=url, role=role)
        self.workers[url] = w
        self._members.clear()
        log.info("worker discovered", extra={"role": role, "url": url})
        if self._started:
            w.task = asyncio.get_running_loop().create_task(self._poll_loop(w))
        return w

    def remove(self, w: Worker) -> None:
        log.info("worker removed", extra={"role": w.role, "url": w.url})
        w.removed = True
        w.up = False
        self.workers.pop(w.url, None)
        self._members.clear()
        if w.pod is not None and self._by_pod.get(w.pod) is w:
            del self._by_pod[w.pod]
        if w.task is not None:
            w.task.cancel()

    def by_pod(self, pod: str) -> Worker | None:
        return self._by_pod.get(pod)

    def sample(self, roles: frozenset[str], k: int, rng: random.Random) -> list[Worker]:
        """`k` of the workers of `roles` picked at random, those ready kept (O(k): the member list is cached)."""
        members = self._members.get(roles)
        if members is None:
            members = self._members[roles] = [w for w in self.workers.values() if w.role in roles]
        n = len(members)
        if k >= n:
            return [w for w in members if w.up]
        # k distinct indices by rejection (k is small against the fleet): random.sample costs several times more
        picked: list[int] = []
        while len(picked) < k:
            i = int(rng.random() * n)
            if i not in picked:
                picked.append(i)
        return [w for i in picked if (w := members[i]).up]

    def start(self) -> None:
        self._started = True
        loop = asyncio.get_running_loop()
        for w in self.workers.values():
            if w.task is None:
                w.task = loop.create_task(self._poll_loop(w))

    async def stop(self) -> None:
        self._started = False
        tasks = [w.task for w in self.workers.values() if w.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _poll_loop(self, w: Worker) -> None:
        # One loop per worker: a hung worker's timeouts never delay the others' polls.
        while not w.removed:
            await self.poll(w)
            await asyncio.sleep(self.poll_interval_s)

    async def poll(self, w: Worker) -> None:
        asked = time.monotonic()
        try:
            status, body = await self.client.get_json_body(f"{w.url}/load", self.poll_timeout_s)
            if status != 200:
                raise ValueError(f"/load answered {status}")
            load = parse_load(json.loads(body))
        except asyncio.CancelledError:
            raise
        except ConnectError as exc:
            # A connect that only timed out is a full accept queue as often as a dead host: slow, not gone.
            self.report_failure(w, f"ConnectError: {exc}", hard=not exc.timed_out)
            return
        except Exception as exc:  # timeouts, resets, garbage: slow or sick, not proven dead
            self.report_failure(w, f"{type(exc).__name__}: {exc}")
            return
        self.report_load(w, load, asked)

    def report_load(self, w: Worker, load: Load, asked: float | None = None) -> None:
        if load.role != w.role:
            self.report_failure(w, f"is a {load.role} worker, listed as {w.role}", hard=True)
            return
        w.load = load
        w.load_asked = time.monotonic() if asked is None else asked
        w.peers.observe(
            w.load_asked,
            load.prompt_tokens_accepted,
            w.placed_prompt_tokens,
            w.placed_uncached_tokens,
            w.placed_prompts,
        )
        if w.role in DECODE_ROLES:
            w.decode_peers.observe(
                w.load_asked, load.decodes_accepted, w.placed_decodes, w.placed_decodes, w.placed_decodes
            )
        if w.pod != load.pod:
            if w.pod is not None and self._by_pod.get(w.pod) is w:
                del self._by_pod[w.pod]
            self._by_pod[load.pod] = w
        w.pod = load.pod
        w.failures = 0
        w.stale = False
        w.last_ok = time.monotonic()
        routable = load.ready and not load.draining
        back = routable and not w.up
        if back:
            log.info("worker up", extra={"role": w.role, "url": w.url, "pod": w.pod})
        elif not routable and w.up:
            log.warning("worker not ready", extra={"role": w.role, "url": w.url, "draining": load.draining})
        w.up = routable
        if back and w.role in PREFILL_ROLES:
            for d in list(self.workers.values()):
                if d is not w and d.role in DECODE_ROLES:
                    for call in list(d.decoding):
                        call.prefill_back()

    def report_failure(self, w: Worker, reason: str, hard: bool = False) -> None:
        """A failed poll; ``hard``: proof the worker is gone (a refused connection), believed at once."""
        w.failures += 1
        w.last_error = reason
        if not w.up:
            return
        silent_s = time.monotonic() - max(w.last_ok, w.last_seen)
        if hard or (w.failures >= self.down_after_failures and silent_s >= self.down_after_s):
            self.mark_down(w, reason)
        elif not w.stale:
            w.stale = True
            log.warning("worker slow to answer; routing on its last load", extra={"url": w.url, "reason": reason})

    def mark_down(self, w: Worker, reason: str) -> None:
        if w.up:
            log.warning("worker down", extra={"role": w.role, "url": w.url, "reason": reason})
        w.up = False
        w.stale = False
        for watched in list(w.watchers):
            watched.kill(f"{w.role} worker {w.url} is down ({reason})")

    async def fresh_loads(self, since: float, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(w.load_asked <= since for w in self.decoders()):
            await asyncio.sleep(0.02)

    def ready(self, role: str, exclude: set[str] | frozenset[str] = frozenset()) -> list[Worker]:
        return self.ready_in({role}, exclude)

    def decoders(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[Worker]:
        return self.ready_in(DECODE_ROLES, exclude)

    def prefillers(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[Worker]:
        return self.ready_in(PREFILL_ROLES, exclude)

    def ready_in(self, roles: set[str] | frozenset[str], exclude: set[str] | frozenset[str]) -> list[Worker]:
        return [w for w in self.workers.values() if w.role in roles and w.up and w.url not in exclude]

    def block_size(self) -> int:
        """KV page size of the fleet (= prefix-index block size)."""
        for w in self.workers.values():
            if w.load is not None:
                return w.load.page_size
        return 16

    def snapshot(self) -> list[dict[str, Any]]:
        return [
            {
                "url": w.url,
                "role": w.role,
                "pod": w.pod,
                "up": w.up,
                "stale": w.stale,
                "poll_failures": w.failures,  # polls failed in a row
                "inflight_requests": w.inflight_requests,
                "inflight_tokens": w.inflight_tokens,
                "running_requests": w.load.running_requests if w.load is not None else None,
                "free_pages": w.load.free_pages if w.load is not None else None,
                "total_pages": w.load.total_pages if w.load is not None else None,
                "last_error": w.last_error or None,
            }
            for w in self.workers.values()
        ]
