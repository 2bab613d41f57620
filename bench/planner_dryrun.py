"""The planner in dry run beside a real prefill + decode pair, against the fleet simulator on the same load.

    python bench/planner_dryrun.py --steps 0.5:20,3:20,0.5:80 --prompt-len 32-64 --output-len 4-8     # CPU
    python bench/planner_dryrun.py --model dummy:llama-3.1-8b --gpus 0,0 --worker-env KVFERRY_KV_MEMORY_GB=30 \
        --steps 4:45,24:60,4:135 --prompt-len 1000-3000 --output-len 64-128 --planner-interval 5 \
        --planner-window 30 --out bench/out/planner_dryrun_h200.json                       # one H200, < 6 min
    python bench/planner_dryrun.py --replay bench/out/planner_dryrun_h200.json   # simulate and compare again

It starts a ``disagg`` deployment with bench/serve_deploy.py (one prefill and one decode worker; ``--gpus 0,0``
puts both on one GPU; on the CPU the router sends prompts from 16 tokens to the prefill worker, so the short
prompts a CPU serves in time are disaggregated too), warms it up until a worker publishes its fitted step model, then starts
``kvferry planner --dry-run`` pointed at the router (its decision interval, rate window and forecast horizon
from ``--planner-interval``, ``--planner-window``, ``--startup``; its KV pool and batch slots those the decode
worker reports on /load). A stepped Poisson load (``--steps RATE:SECONDS,...``, bench/serve_load.py's client
and workloads) goes through the router while the planner's exported gauges (what it asks for, what it sized,
the arrival rate and queue wait it measured) are sampled every half second and its "decision" log lines kept.

Then the fleet simulator (bench/fleet_sim/) replays the requests exactly as they were sent (send times and
lengths) on one prefill and one decode simulated worker, the planner's own code deciding every interval from
the simulated router's counters, in dry run as well (nothing is scaled, as nothing is on the real side). The
simulated worker's step times come from:
  - ``h200`` (with ``--gpus``): bench/fleet_sim/h200.py, the simulator's calibration of one H200 worker, the
    workers time-sharing a GPU as they do here (``--gpus 0,0``; its planner sizes with those coefficients too):
    the simulator predicting on its own;
  - ``published``: the median over the load of the coefficients the real workers fitted and published on /load,
    its planner sizing at each decision with the coefficients the real planner read by then (sampled every
    half second). The simulator has no CPU calibration (bench/fleet_sim/calibrate.py fits H200 runs only), so on the CPU
    this is the one source, and what compares is the decisions' direction and timing.
Printed and saved (``--out``): the decision sequence (target prefill / decode over time) real against simulated,
the arrival rate and queue wait each measured, the first scale-up after the first step up, and the match ratio
(the share of the decision times, every interval over the load, at which the simulated planner held the real
one's targets; and within one interval, as the two decide at different phases of it).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

from serve import DEFAULT_MODEL, OUT_DIR, git_commit, host_info, model_shape, parse_env, run_asyncio  # noqa: E402
from serve_deploy import DeployError, DeploySpec, get_json, settle_logs, start_deployment  # noqa: E402
from serve_load import Arrivals, LoadClient, RequestRecord, TokenRange, make_workload, run_point  # noqa: E402
from synthetic_tokenizer import build_word_tokenizer, count_words  # noqa: E402

from bench.fleet_sim.controllers import PlannerController  # noqa: E402
from bench.fleet_sim.fleet import Fleet, FleetConfig  # noqa: E402
from bench.fleet_sim.h200 import H200_LLAMA8B, NET_S  # noqa: E402
from bench.fleet_sim.worker import WorkerSpec  # noqa: E402
from bench.fleet_sim.workload import SimRequest  # noqa: E402
from common.capacity import StepCost  # noqa: E402
from common.devcluster.process import ManagedProcess, kvferry_argv  # noqa: E402
from common.net import free_port  # noqa: E402
from common.slo import DEFAULT_SLO_SPEC, parse_slo_classes  # noqa: E402
from planner.main import build_parser as planner_parser  # noqa: E402
from planner.main import build_planner  # noqa: E402
from planner.sizing import Counts, OfferedLoad  # noqa: E402
from planner.source import median_cost, median_of  # noqa: E402
from router.runtime import policy_config  # noqa: E402
from router.settings import RouterOptions  # noqa: E402

GAUGES = {
    "kvferry_planner_desired_replicas": "desired",
    "kvferry_planner_planned_replicas": "planned",
}
SCALARS = {
    "kvferry_planner_arrival_rate": "rate",
    "kvferry_planner_forecast_rate": "forecast_rate",
    "kvferry_planner_queue_wait_seconds": "queue_wait_s",
}
CPU_SLO = "interactive:ttft=2s,itl=100ms,p=99"  # a 135M model's CPU steps, two workers sharing the cores
CPU_DISAGG_MIN_PROMPT = 16
DECISION_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d) info kvferry\.planner: decision targets=(\{.*?\}) reasons=(\{.*\})")
# A reading no router answered: the planner decides nothing that interval (a frozen router process looks so).
MISSED_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d) warning kvferry\.planner: no reading")
# Every decision of a dry run (changed or not): the first tells when the planner began reading, before the load.
DRY_RUN_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d) info kvferry\.planner: dry run: would scale")


def say(msg: str) -> None:
    print(msg, flush=True)


@dataclass(frozen=True)
class Step:
    rate: float  # requests/s
    seconds: float


def parse_steps(text: str) -> list[Step]:
    steps = []
    for part in text.split(","):
        rate, sep, seconds = part.strip().partition(":")
        if not sep or float(rate) <= 0 or float(seconds) <= 0:
            raise SystemExit(f"bad step {part!r} (RATE:SECONDS, both > 0)")
        steps.append(Step(float(rate), float(seconds)))
    return steps


def arrivals_within(rate: float, seconds: float, seed: int) -> int:
    """How many of run_point's Poisson sends (the same seed, the same draws) fall within `seconds`."""
    rng, t, n = random.Random(seed), 0.0, 0
    while t < seconds:
        n += 1
        t += rng.expovariate(rate)
    return n


# ---- the real side ---------------------------------------------------------------------------------------------
class PlannerSampler:
    """Reads the planner's /metrics every `period_s` (a thread): its gauges over time, from `t0` on; and every
    `cost_every` readings the step cost it sizes with (the workers' fits, as planner/source.py takes them)."""

    def __init__(self, url: str, workers: list[str], period_s: float = 0.5, cost_every: int = 1) -> None:
        self.url, self.workers, self.period_s, self.cost_every = url, workers, period_s, cost_every
        self.t0 = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def read(self) -> dict[str, Any] | None:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        out: dict[str, Any] = {"desired": {}, "planned": {}}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in GAUGES:
                    out[GAUGES[s.name]][s.labels["role"]] = int(s.value)
                elif s.name in SCALARS:
                    out[SCALARS[s.name]] = s.value
        return out if out["desired"] else None  # no decision exported yet

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            got = self.read()
            if got is not None:
                if n % self.cost_every == 0:
                    cost = median_cost(worker_loads(self.workers))
                    if cost is not None:
                        got["cost"] = cost.as_map()
                n += 1
                self.samples.append({"t": round(time.monotonic() - self.t0, 2), **got})
            self._stop.wait(self.period_s)


def _log_t(m: re.Match[str], wall0: float) -> float:
    """A log line's time (its clock: whole seconds, the day's) in seconds from `wall0`."""
    start = time.localtime(wall0)
    day0 = start.tm_hour * 3600 + start.tm_min * 60 + start.tm_sec + (wall0 % 1)
    h, mi, s = (int(x) for x in m.groups()[:3])
    t = (h * 3600 + mi * 60 + s - day0) % 86400
    return round(t if t < 43200 else t - 86400, 1)


def decision_lines(log: Path, wall0: float) -> list[dict[str, Any]]:
    """The planner's "decision" log lines (targets changed), timed from `wall0`."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = DECISION_LINE.match(line)
        if m:
            targets, reasons = ast.literal_eval(m.group(4)), ast.literal_eval(m.group(5))
            out.append(
                {
                    "t": _log_t(m, wall0),
                    "desired": {k: v for k, v in targets.items() if k != "mixed"},
                    "reasons": {k: v for k, v in reasons.items() if v},
                }
            )
    return out


def missed_readings(log: Path, wall0: float) -> list[float]:
    """When the planner read no router (it decided nothing then), timed from `wall0`."""
    return [_log_t(m, wall0) for line in log.read_text(errors="replace").splitlines() if (m := MISSED_LINE.match(line))]


def planner_lead_s(log: Path, wall0: float, interval_s: float) -> float:
    """How long before `wall0` the planner took its first reading: its first decision (which needs a second
    reading) less one interval."""
    for line in log.read_text(errors="replace").splitlines():
        if m := DRY_RUN_LINE.match(line):
            return max(0.0, interval_s - _log_t(m, wall0))
    return 0.0


def worker_loads(urls: list[str]) -> list[dict[str, Any]]:
    return [load for load in (get_json(f"{u}/load", 5.0) for u in urls) if load]


async def stepped_load(
    url: str, steps: list[Step], args: argparse.Namespace, vocab: int
) -> tuple[list[tuple[int, float, RequestRecord]], float]:
    """Each step's Poisson sends, all steps on one clock; (step, offset of its start, record) per request, and
    the load's start (monotonic)."""
    async with LoadClient(url, args.request_timeout) as client:
        client.count_tokens = count_words
        offsets = [sum(s.seconds for s in steps[:i]) for i in range(len(steps))]
        t0 = time.monotonic()

        async def one(i: int, step: Step) -> list[RequestRecord]:
            seed = args.seed * 1000 + i
            items = make_workload(
                arrivals_within(step.rate, step.seconds, seed),
                args.prompt_len,
                args.output_len,
                vocab,
                seed,
                args.model,
            )
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.monotonic()))
            say(f"  step {i}: {step.rate:g} req/s for {step.seconds:g} s ({len(items)} requests)")
            run = await run_point(client, items, Arrivals("rate", step.rate), seed, args.drain_timeout)
            return run.records

        runs = await asyncio.gather(*(one(i, s) for i, s in enumerate(steps)))
    return [(i, offsets[i], r) for i, recs in enumerate(runs) for r in recs], t0


async def warm_up(url: str, args: argparse.Namespace, vocab: int, loads: Any) -> None:
    """Requests until a worker has fitted its step model (the planner sizes nothing before one has)."""
    async with LoadClient(url, args.request_timeout) as client:
        client.count_tokens = count_words
        deadline = time.monotonic() + args.ready_timeout
        for round_ in range(1000):
            items = make_workload(2, args.prompt_len, args.output_len, vocab, 10_000_000 + round_, args.model)
            # one at a time, a refusal retried: before its model is fitted the router's TTFT estimate is a guess
            run = await run_point(client, items, Arrivals("concurrency", 1), 0, args.drain_timeout, retry_429=True)
            bad = [(r.outcome, r.http_status, r.error) for r in run.records if r.outcome != "ok"]
            if bad:
                raise DeployError(f"warm-up failed: {bad}")
            # a decode worker that prefills nothing never fits (its model needs timed prompt chunks)
            if any(w.get("step_coefficients") for w in loads()):
                return
            if time.monotonic() > deadline:
                raise DeployError("the workers published no step model within --ready-timeout")


def step_summary(rows: list[tuple[int, float, RequestRecord]], steps: list[Step]) -> list[dict[str, Any]]:
    out = []
    for i, step in enumerate(steps):
        recs = [r for s, _, r in rows if s == i]
        ttft = sorted(r.ttft_s for r in recs if r.ttft_s is not None)
        out.append(
            {
                "rate": step.rate,
                "seconds": step.seconds,
                "sent": len(recs),
                "ok": sum(r.outcome == "ok" for r in recs),
                "http_429": sum(r.outcome == "http_429" for r in recs),
                "other": sum(r.outcome not in ("ok", "http_429") for r in recs),
                "ttft_p50_s": _pct(ttft, 50),
                "ttft_p99_s": _pct(ttft, 99),
            }
        )
    return out


def _pct(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else None


# ---- the simulated side -----------------------------------------------------------------------------------------
@dataclass
class DryRunController:
    """The simulator's planner controller, its decisions recorded and none applied (the real planner's --dry-run).
    With `costs` ((t, step cost), in time order) its planner sizes with the cost the real one read by then."""

    inner: PlannerController
    costs: list[tuple[float, StepCost]] = field(default_factory=list)
    # how long the real planner read the idle fleet before the load began: its first windows held that idle time,
    # which its rate forecast's trend carried into the step (the H100's run: forecast 11.6 req/s where the
    # simulated planner, reading from the load's start, forecast 9.4, and a prefill pod more for 15 s)
    lead_s: float = 0.0
    _led: bool = False

    @property
    def interval_s(self) -> float:
        return self.inner.interval_s

    def tick(self, fleet: Fleet, now: float) -> Counts | None:
        if not self._led:
            self._led = True
            for k in range(round(self.lead_s / self.interval_s), 0, -1):  # on the simulated planner's grid
                self.tick(fleet, now - k * self.interval_s)
        if self.costs:
            cost = next((c for t, c in reversed(self.costs) if t <= now), self.costs[0][1])
            self.inner.planner.spec = replace(self.inner.planner.spec, cost=cost)
        self.inner.tick(fleet, now)
        return None


def simulate(
    reqs: list[SimRequest],
    fleet_cfg: FleetConfig,
    slo: str,
    router_env: dict[str, str],
    planner_argv: list[str],
    until: float,
    planner_costs: list[tuple[float, StepCost]],
    lead_s: float = 0.0,
) -> dict[str, Any]:
    classes = parse_slo_classes(slo)
    policy = policy_config(RouterOptions.from_env(router_env), classes)  # the real router's, from the same env
    cfg = replace(fleet_cfg, slo=classes, policy=policy, startup_s=0.0)
    worker = cfg.worker
    pargs = planner_parser().parse_args(planner_argv)
    planner = build_planner(pargs)
    planner.spec = replace(planner.spec, cost=worker.published)  # what the real one reads from /load
    ctl = PlannerController(planner, OfferedLoad(0.0, 1.0, 1.0), window_s=pargs.window)  # main.step's fallback
    fleet = Fleet(cfg, Counts(prefill=1, decode=1), DryRunController(ctl, planner_costs, lead_s))
    res = fleet.run(reqs, until=until)
    timeline = [
        {
            "t": d.t,
            "desired": {k: v for k, v in d.targets.__dict__.items() if k != "mixed"},
            "planned": {k: v for k, v in d.planned.__dict__.items() if k != "mixed"},
            "rate": tl["rate"],
            "forecast_rate": d.forecast_rate,
            "queue_wait_s": tl["queue_wait_s"],
            "reasons": {k: v for k, v in d.reasons.items() if v},
        }
        for d, tl in zip(ctl.decisions, res.timeline)
    ]
    summary = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.summary().items()}
    return {
        "worker": {**worker.published.as_map(), "kv_tokens": worker.kv_tokens},
        "result": summary,
        "timeline": timeline,
    }


# ---- the comparison ---------------------------------------------------------------------------------------------
def _pd(x: dict[str, Any]) -> tuple[int, int]:
    d = x["desired"]
    return int(d.get("prefill", 0)), int(d.get("decode", 0))


def _at(timeline: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    held = None
    for x in timeline:
        if x["t"] > t + 1e-9:
            break
        held = x
    return held


def first_up(timeline: list[dict[str, Any]], after: float) -> float | None:
    """Seconds from `after` to the first time the targets rose above those held at `after`."""
    before = _at(timeline, after) or (timeline[0] if timeline else None)
    if before is None:
        return None
    base = _pd(before)
    for x in timeline:
        if x["t"] >= after and any(a > b for a, b in zip(_pd(x), base)):
            return round(x["t"] - after, 2)
    return None


def compare(
    real: list[dict[str, Any]], measured: list[dict[str, Any]], sim: list[dict[str, Any]], end: float, interval: float
) -> dict[str, Any]:
    """On the planner's interval grid over the load: the targets each held; matched where both agree, and
    "near" where the simulated planner held the real one's targets within one interval (the two decide at
    different phases of their interval)."""
    grid = [round(k * interval, 3) for k in range(int(end / interval) + 1)]
    rows = []
    for t in grid:
        r, m, s = _at(real, t), _at(measured, t), _at(sim, t)
        if r is None or m is None or s is None:
            continue
        rows.append(
            {
                "t": t,
                "real": _pd(r),
                "sim": _pd(s),
                "real_rate": round(m.get("rate", 0.0), 3),
                "sim_rate": round(s["rate"], 3),
                "real_wait_s": round(m.get("queue_wait_s", 0.0), 3),
                "sim_wait_s": round(s["queue_wait_s"], 3),
                "near": _pd(r) in {_pd(y) for y in (_at(sim, t - interval), s, _at(sim, t + interval)) if y},
            }
        )
    n = len(rows)
    return {
        "rows": rows,
        "points": n,
        "match_ratio": sum(x["real"] == x["sim"] for x in rows) / n if n else None,
        "match_ratio_within_interval": sum(x["near"] for x in rows) / n if n else None,
        # a pod either way per role: where the two sized within a rounding of each other (one reading's mean
        # prompt a few percent apart tips a count near its boundary)
        "match_ratio_within_one_pod": (
            sum(all(abs(a - b) <= 1 for a, b in zip(x["real"], x["sim"])) for x in rows) / n if n else None
        ),
    }


def changes(timeline: list[dict[str, Any]]) -> list[tuple[float, tuple[int, int]]]:
    out: list[tuple[float, tuple[int, int]]] = []
    for x in timeline:
        if not out or out[-1][1] != _pd(x):
            out.append((x["t"], _pd(x)))
    return out


def fmt_changes(seq: list[tuple[float, tuple[int, int]]]) -> str:
    return " -> ".join(f"{p}P+{d}D@{t:.0f}s" for t, (p, d) in seq) or "(none)"


def print_report(result: dict[str, Any]) -> None:
    for i, s in enumerate(result["real"]["steps"]):
        p50, p99 = s["ttft_p50_s"], s["ttft_p99_s"]
        say(
            f"step {i} ({s['rate']:g} req/s x {s['seconds']:g} s): {s['sent']} sent, {s['ok']} ok, {s['http_429']} "
            f"shed, {s['other']} other; TTFT p50 {p50 if p50 is None else round(p50, 3)} s p99 "
            f"{p99 if p99 is None else round(p99, 3)} s"
        )
    missed = result["real"].get("missed_readings") or []
    if missed:  # the real planner decided nothing at these times: that side of the comparison is not its own
        say(f"the real planner read no router {len(missed)} times, first at {missed[0]:.0f} s")
    for name, cmp in result["comparison"].items():
        say(f"== simulated with the {name} step model: {result['sim'][name]['worker']}")
        say(f"{'t':>6} {'real P+D':>9} {'sim P+D':>8} {'rate real':>10} {'sim':>6} {'wait real':>10} {'sim':>7}")
        for r in cmp["rows"]:
            mark = "" if r["real"] == r["sim"] else "  ~" if r["near"] else "  *"
            real, sim = "{}+{}".format(*r["real"]), "{}+{}".format(*r["sim"])
            say(
                f"{r['t']:6.0f} {real:>9} {sim:>8} {r['real_rate']:10.2f} "
                f"{r['sim_rate']:6.2f} {r['real_wait_s']:10.2f} {r['sim_wait_s']:7.2f}{mark}"
            )
        up = cmp["first_up_after_step_s"]
        say(f"real: {fmt_changes(cmp['real_changes'])}")
        say(f"sim:  {fmt_changes(cmp['sim_changes'])}")
        ratio, near, pod = cmp["match_ratio"], cmp["match_ratio_within_interval"], cmp["match_ratio_within_one_pod"]
        say(
            f"first scale-up after the step up at {up['step_at_s']} s: real +{up['real']} s, sim +{up['sim']} s; "
            f"match ratio {_r3(ratio)} ({_r3(near)} within one interval, {_r3(pod)} within a pod) over "
            f"{cmp['points']} decision times"
        )


def _r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _load(url: str, steps: list[Step], args: argparse.Namespace, vocab: int) -> tuple[list, float]:
    got: list[tuple[list, float]] = []

    async def run() -> None:
        got.append(await stepped_load(url, steps, args, vocab))

    run_asyncio(run())
    return got[0]


def analyse(result: dict[str, Any]) -> None:
    """The simulated side and the comparison, from what the real run recorded (`result`, as saved)."""
    cfg, real = result["config"], result["real"]
    steps = [Step(**x) for x in cfg["steps"]]
    end = sum(s.seconds for s in steps)
    reqs = sorted((SimRequest(t, p, max(1, o)) for _, t, p, o, *_ in real["requests"]), key=lambda q: q.t)
    read = [(x["t"], StepCost.from_map(x["cost"])) for x in real["samples"] if "cost" in x]
    during = [c for t, c in read if 0 <= t <= end]
    published = median_of(during) if during else median_cost(real["worker_loads"])
    decode = real["decode_worker"]
    base = dict(
        itl_target_s=parse_slo_classes(cfg["slo"]).classes[0].itl_s,
        max_prefill_tokens=real["chunk_tokens"],
        max_running=decode["max_running"],
        kv_tokens=decode["kv_tokens"],
        page_size=decode["page_size"],
    )
    sources: dict[str, tuple[FleetConfig, list[tuple[float, StepCost]]]] = {}
    if cfg["gpus"] and any("H200" in g for g in result.get("host", {}).get("gpus", [])):
        # `--gpus 0,0`: the two workers time-share one GPU (bench/fleet_sim/device.py); the H200's own step model
        # (on another card it only says the cards differ: the H100's runs matched it 0.182)
        per_gpu = len(cfg["gpus"]) // len(set(cfg["gpus"]))
        sources["h200"] = (FleetConfig(replace(H200_LLAMA8B, **base), net_s=NET_S, workers_per_gpu=per_gpu), [])
    if published is not None:
        # the simulated workers step at the load's median fit; its planner sizes with what the real one read
        # (their fits already hold whatever else ran on their device: each simulated worker has its own)
        sources["published"] = (FleetConfig(WorkerSpec(cost=published, **base)), read)
    up_at = next(
        (sum(s.seconds for s in steps[:i]) for i in range(1, len(steps)) if steps[i].rate > steps[i - 1].rate), None
    )
    # the real targets over time: the planner's own decision lines (its gauges, sampled, lag them a little)
    log_lines = real["decision_log"]
    start = min([-1.0] + [x["t"] - 1 for x in log_lines])
    real_targets = [{"t": start, "desired": {"prefill": 1, "decode": 1}}, *log_lines]
    real_up = first_up(real_targets, up_at) if up_at is not None else None
    router_env = {**os.environ, **real["router_env"]}
    result["sim"], result["comparison"] = {}, {}
    for name, (fleet_cfg, costs) in sources.items():
        lead = real.get("planner_lead_s", 0.0)  # runs before it was recorded: 0, as they were simulated
        sim = simulate(reqs, fleet_cfg, cfg["slo"], router_env, real["planner_argv"], end, costs, lead)
        cmp = compare(real_targets, real["samples"], sim["timeline"], end, cfg["planner_interval"])
        cmp["first_up_after_step_s"] = {
            "step_at_s": up_at,
            "real": real_up,
            "sim": first_up(sim["timeline"], up_at) if up_at is not None else None,
        }
        cmp["real_changes"] = changes([x for x in real_targets if x["t"] <= end])
        cmp["sim_changes"] = changes(sim["timeline"])
        result["sim"][name], result["comparison"][name] = sim, cmp
    print_report(result)


# ---- main -------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--gpus", type=lambda s: [g.strip() for g in s.split(",") if g.strip()], default=[])
    p.add_argument("--steps", type=parse_steps, default=parse_steps("0.5:20,3:20,0.5:20"), help="RATE:SECONDS,...")
    p.add_argument("--prompt-len", type=TokenRange.parse, default=TokenRange(32, 64))
    p.add_argument("--output-len", type=TokenRange.parse, default=TokenRange(4, 8))
    p.add_argument(
        "--slo",
        default=None,
        help=f"SLO classes: the router's, the workers' and the planner's (default: {CPU_SLO} on the CPU, "
        f"{DEFAULT_SLO_SPEC} with --gpus)",
    )
    p.add_argument("--planner-interval", type=float, default=2.0, help="seconds between the planner's decisions")
    p.add_argument("--planner-window", type=float, default=10.0, help="seconds its rates are read over")
    p.add_argument("--startup", type=float, default=60.0, help="a new pod's seconds to ready (its forecast horizon)")
    p.add_argument("--worker-env", action="append", default=[], metavar="K=V")
    p.add_argument("--router-env", action="append", default=[], metavar="K=V")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--drain-timeout", type=float, default=120.0, help="after a step's last send")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=None, help="keep the parts' logs here (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=None, help="JSON (default bench/out/planner_dryrun_<time>.json)")
    p.add_argument("--replay", type=Path, default=None, help="a saved run: simulate and compare again (no deployment)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replay:
        result = json.loads(args.replay.read_text())
        analyse(result)
        (args.out or args.replay).write_text(json.dumps(result, indent=1, default=str))
        return 0
    steps: list[Step] = args.steps
    args.slo = args.slo or (DEFAULT_SLO_SPEC if args.gpus else CPU_SLO)
    vocab, max_context = model_shape(args.model)
    out = args.out or OUT_DIR / f"planner_dryrun_{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvferry-plandry-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    worker_env = {"KVFERRY_SLO_CLASSES": args.slo, **parse_env(args.worker_env)}
    router_env = {"KVFERRY_SLO_CLASSES": args.slo, **parse_env(args.router_env)}
    if not args.gpus:  # the CPU's short prompts go to the prefill worker too (else the decode worker prefills them)
        router_env.setdefault("KVFERRY_ROUTER_DISAGG_MIN_PROMPT_TOKENS", str(CPU_DISAGG_MIN_PROMPT))
    if not args.gpus and "KVFERRY_TORCH_THREADS" not in {**os.environ, **worker_env}:
        worker_env["KVFERRY_TORCH_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // 2))
    spec = DeploySpec(
        mode="disagg",
        model=args.model,
        tokenizer_dir=str(build_word_tokenizer(log_dir / "tokenizer", vocab, max_context)),
        gpus=tuple(args.gpus),
        worker_env=worker_env,
        router_env=router_env,
        ready_timeout_s=args.ready_timeout,
        log_dir=log_dir,
    )
    result: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, (TokenRange, Path)) else v for k, v in vars(args).items()},
        "git": git_commit(),
        "host": host_info(),
        "load_average_at_start": os.getloadavg(),
    }
    result["config"]["steps"] = [s.__dict__ for s in steps]
    say(f"starting prefill + decode ({args.model}, logs in {log_dir})")
    started = time.monotonic()
    deployment = start_deployment(spec, say)
    planner: ManagedProcess | None = None
    failed = False
    try:
        say(f"ready in {time.monotonic() - started:.0f} s")
        urls = [p.url for p in deployment.workers if p.url]
        run_asyncio(warm_up(deployment.router_url, args, vocab, lambda: worker_loads(urls)))
        loads = worker_loads(urls)
        decode = next(w for w in loads if w.get("role") == "decode")
        kv_tokens = int(decode["total_pages"]) * int(decode["page_size"])
        port = free_port()
        planner_argv = [
            "--dry-run",
            f"--routers={deployment.router_url}",
            f"--slo={args.slo}",
            f"--interval={args.planner_interval:g}",
            f"--window={args.planner_window:g}",
            f"--startup={args.startup:g}",
            "--min=prefill=1,decode=1",
            f"--chunk-tokens={int(worker_env.get('KVFERRY_MAX_PREFILL_TOKENS', 2048))}",
            f"--max-running={int(decode['max_running'])}",
            f"--kv-tokens={kv_tokens}",
            f"--port={port}",
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "KVFERRY_LOG_LEVEL": "INFO"}
        planner = ManagedProcess(
            "planner", kvferry_argv("planner", *planner_argv), env, log_dir / "planner.log", cwd=REPO
        )
        planner.start()
        sampler = PlannerSampler(f"http://127.0.0.1:{port}", urls)
        # its rates are counter differences between its own readings: the warm-up, done before, is in none
        deadline = time.monotonic() + args.planner_window + 3 * args.planner_interval + 30
        while sampler.read() is None:
            if not planner.alive() or time.monotonic() > deadline:
                raise DeployError(f"the planner exported no decision:\n{planner.log_tail(30)}")
            time.sleep(0.5)
        say(
            f"planner deciding (dry run, every {args.planner_interval:g} s); load: "
            + ", ".join(f"{s.rate:g} req/s x {s.seconds:g} s" for s in steps)
        )
        wall0 = time.time()
        sampler.t0 = time.monotonic()
        sampler.start()
        rows, t0 = _load(deployment.router_url, steps, args, vocab)
        shift = t0 - sampler.t0  # the sampler's clock is a hair earlier than the load's
        sampler.stop()
        planner.stop()
        real_samples = [{**x, "t": round(x["t"] - shift, 2)} for x in sampler.samples]
        result["real"] = {
            "worker_loads": [
                {k: w.get(k) for k in ("role", "step_coefficients", "total_pages", "page_size", "max_running")}
                for w in worker_loads(urls)
            ],
            "planner_argv": planner_argv,
            "router_env": router_env,
            "decode_worker": {
                "max_running": int(decode["max_running"]),
                "kv_tokens": kv_tokens,
                "page_size": int(decode["page_size"]),
            },
            "chunk_tokens": int(worker_env.get("KVFERRY_MAX_PREFILL_TOKENS", 2048)),
            "steps": step_summary(rows, steps),
            "requests": [  # (step, sent s from the load's start, prompt, max_tokens, outcome, TTFT s)
                [i, round(off + r.sent_s, 4), r.prompt_len, r.max_tokens, r.outcome, r.ttft_s] for i, off, r in rows
            ],
            "samples": real_samples,
            "decision_log": decision_lines(log_dir / "planner.log", wall0 + shift),
            "missed_readings": missed_readings(log_dir / "planner.log", wall0 + shift),
            "planner_lead_s": planner_lead_s(log_dir / "planner.log", wall0 + shift, args.planner_interval),
        }
        result["load_average_at_end"] = os.getloadavg()
        analyse(result)
    except (DeployError, KeyboardInterrupt) as exc:
        failed = True
        result["error"] = str(exc)
        say(f"failed: {exc}")
    finally:
        if planner is not None:
            planner.stop()
        deployment.stop()
        out.write_text(json.dumps(result, indent=1, default=str))
        say(f"wrote {out}")
    settle_logs(log_dir, failed, bool(args.log_dir), say)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
