"""Decode throughput with grammars and with penalties against none, same engine, same run.

    python bench/grammar_decode.py                    # CPU, 16 requests x 64 tokens, 5 rounds
    python bench/grammar_decode.py --device cuda --num-requests 128 --max-tokens 256
    # dummy weights of the packaged model's shape, the real tokenizer's grammar (the vocabularies match):
    python bench/grammar_decode.py --device cuda --model dummy:smollm2-135m --tokenizer <dir with tokenizer.json>
    python bench/grammar_decode.py --device cuda --model dummy:llama-3.1-8b --cases penalties

Workload: `--num-requests` chat prompts submitted at once, each generating exactly `--max-tokens` tokens
(min_tokens = max_tokens bans EOS; the schema's story field is too long to complete in the run). The
baseline: no grammar, no penalty. Cases (`--cases`): `half_grammar`: every other request under a JSON schema
(an object with free-text and enum fields), the rest as the baseline; `all_grammar`: every request under it;
`penalties`: every request with frequency 0.5, presence 0.3 and repetition 1.1 penalties. Throughput =
output tokens / wall time of the batch (prefill included: the same in all). Rounds run the baseline and then
each case; the best of each counts. Targets (ratio to the baseline): half_grammar >= 0.9, all_grammar >=
0.85, penalties >= 0.95. Without a tokenizer (dummy weights, no `--tokenizer`) the prompts are random token
ids and only `penalties` runs. `--check`: first decodes a mix (grammar, penalty, seeded and plain rows) with
overlap on and off on the same engine and records whether the tokens are identical. Writes
`bench/out/grammar_<device>[_<model>].json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT_DIR = Path(__file__).resolve().parent / "out"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "mood": {"type": "string", "enum": ["happy", "sad", "calm"]},
        "story": {"type": "string", "minLength": 4000},  # cannot complete within the run: equal lengths
    },
    "required": ["title", "mood", "story"],
    "additionalProperties": False,
}
TOPICS = ["the sea", "a robot", "a city at night", "a dragon", "the moon", "a library", "a storm", "a garden"]
PENALTIES = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)
TARGETS = {"half_grammar": 0.9, "all_grammar": 0.85, "penalties": 0.95}


def case_params(case: str, n: int, max_tokens: int, seeded: bool = False) -> list:
    from common.protocol import GrammarSpec, SamplingParams

    spec = GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA))
    out = []
    for i in range(n):
        kw: dict = {}
        if case == "all_grammar" or (case == "half_grammar" and i % 2 == 0):
            kw["grammar"] = spec
        if case == "penalties":
            kw.update(PENALTIES)
        if case == "mix":  # the overlap check: every kind of row in one batch
            kw = [dict(grammar=spec), PENALTIES, dict(grammar=spec, **PENALTIES), {}][i % 4]
        if seeded and i % 3 == 1:
            kw.update(temperature=0.8, top_p=0.95, seed=i)
        out.append(SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, **kw))
    return out


class HostClock:
    """Host seconds spent per scheduler phase (`--host-phases`): wraps the scheduler's methods for one run.
    "wait" is the time blocked on a step's done event, inside "process"."""

    PHASES = {"launch": "_launch", "process": "_process", "sample": "_sample", "decode_rows": "_decode_rows"}
    RUNNER_PHASES = {"build_batch": "build_batch", "forward": "forward"}

    def __init__(self, sched) -> None:
        from concurrent.futures import Future

        from common.sched.launched import Launched

        self.seconds: dict[str, float] = {}
        self._undo = []
        for name, attr in self.PHASES.items():
            self._wrap(sched, attr, name)
        for name, attr in self.RUNNER_PHASES.items():
            self._wrap(sched.runner, attr, name)
        self._wrap(sched.grammars, "fill", "fill")
        self._wrap(Launched, "wait", "wait", cls=True)
        self._wrap(Future, "result", "join", cls=True)  # the scheduler's thread waiting for the fill thread
        # Inside "sample": the sampler as a whole, its penalty state, and the sampling ops themselves.
        import common.sched.step_sampling as step_sampling

        self._wrap(sched.sampler, "sample", "sampler")
        self._wrap(step_sampling, "sample", "sample_ops", cls=True)
        for name in ("plan", "begin", "view", "record"):
            self._wrap(sched.sampler.penalties, name, f"penalty_{name}")
        if sched.device.type == "cuda":
            import common.engine.gpu.penalty as kernels

            self._wrap(kernels, "penalize", "penalize_kernel", cls=True)

    def _wrap(self, obj, attr: str, name: str, cls: bool = False) -> None:
        inner = getattr(obj, attr)

        self.seconds[name] = 0.0

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - t

        setattr(obj, attr, timed)
        self._undo.append((obj, attr, inner, cls))

    def close(self) -> dict[str, float]:
        for obj, attr, inner, cls in reversed(self._undo):
            if cls:
                setattr(obj, attr, inner)
            else:
                delattr(obj, attr)
        return {k: round(v, 4) for k, v in self.seconds.items()}


ALLOCATOR_STATS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_stats() -> dict[str, int]:
    """The CUDA caching allocator's counters that mean a device sync or a driver call (empty on the CPU)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_STATS}


def run(engine, prompts: list[list[int]], params: list, host_phases: bool = False) -> dict:
    clock = HostClock(engine.scheduler) if host_phases else None
    before = allocator_stats()
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    after = allocator_stats()
    tokens = sum(len(r.output_ids) for r in results)
    out = {
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "errors": sum(r.finish_reason == "error" for r in results),
    }
    if after:  # a retry or a device free inside a run synchronizes the device: the overlap is lost there
        out["allocator"] = {k: after[k] - before[k] for k in after}
    if clock is not None:
        out["host_s"] = clock.close()
    return out


class _Inline:
    """An executor that runs a job at once on the caller's thread (the fill without its thread)."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        done: Future = Future()
        done.set_result(fn(*args))
        return done

    def shutdown(self, wait: bool = True) -> None:
        pass


def fill_mode(engine, mode: str):
    """Diagnostic variants of the grammar fill (`--fill-modes`): `thread` (as served), `inline` (no thread),
    `cfill` (xgrammar's batched fill alone on the thread: no accept, no per-row Python, so its masks stay those
    of each grammar's start and a request's last token usually breaks it: timing only). Returns an undo."""
    from common.sched.grammar import GrammarMasks, _batch_fill

    sched = engine.scheduler
    sampler, book = sched.sampler, sched.grammars
    if mode == "inline":
        sampler._fill_thread = _Inline()
        return lambda: setattr(sampler, "_fill_thread", None)
    if mode == "cfill":

        def fill(reqs, bits=None):
            batch = book._grammar_rows(reqs)
            _batch_fill(book._batch, batch.handles, bits, batch.rows)
            return GrammarMasks(bits, batch.rows, [False] * len(reqs), [])

        book.fill = fill
        return lambda: book.__dict__.pop("fill", None)
    return lambda: None


def overlap_check(engine, prompts: list[list[int]], has_grammar: bool) -> dict:
    """Tokens of the mix with overlap on and off (every row runs to max_tokens: the batches are the same)."""
    from common.sched.scheduler import Scheduler

    case = "mix" if has_grammar else "penalties"
    params = case_params(case, len(prompts), 32, seeded=True)
    original = engine.scheduler
    outputs = {}
    for overlap in (True, False):
        sched = Scheduler(engine.runner, original.cfg, overlap=overlap)
        sched.grammars = original.grammars
        engine.scheduler = sched
        outputs[overlap] = [r.output_ids for r in engine.generate(prompts, params)]
    engine.scheduler = original
    same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
    return {"case": case, "requests": len(prompts), "identical": same == len(prompts), "identical_requests": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="", help="a model dir or dummy:<named config> (default: the packaged one)")
    ap.add_argument("--tokenizer", default="", help="with dummy weights: a dir whose tokenizer the grammar uses")
    ap.add_argument("--cases", default="half_grammar,all_grammar,penalties")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="first compare overlap on and off on a mixed batch")
    ap.add_argument("--host-phases", action="store_true", help="one more round per case, timing the host's phases")
    ap.add_argument("--fill-threads", default="", help="with --host-phases: all_grammar again per thread count")
    ap.add_argument(
        "--fill-modes",
        default="",
        help="all_grammar again per fill variant: thread,inline,cfill (diagnostics; see fill_mode)",
    )
    ap.add_argument(
        "--switch-intervals", default="", help="seconds (comma-separated): every case again per GIL switch interval"
    )
    ap.add_argument("--sync-debug", action="store_true", help="CUDA: list the ops that synchronize, per case")
    ap.add_argument(
        "--profile",
        default="",
        help="cases (comma-separated) to run once more under torch.profiler: top host ops, and device kernels on CUDA",
    )
    ap.add_argument("--cprofile", default="", help="cases (comma-separated) to run once more under cProfile")
    ap.add_argument("--profile-tokens", type=int, default=32, help="output tokens per request in a profiled run")
    ap.add_argument("--out", default="", help="JSON path (default bench/out/grammar_<device>[_<model>].json)")
    ap.add_argument("--overlap", default="auto", help="the scheduler's overlap: auto | on | off (on: the GPU's loop)")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from common.default_model import convert_default_model
    from common.engine.threads import apply_engine_threads
    from common.offline import Engine
    from common.sched.grammar import GrammarBook
    from common.settings import RunnerConfig, SchedulerConfig
    from common.settings_registry import TORCH_THREADS

    # As a worker process sets them (4 on a GPU unless KVFERRY_TORCH_THREADS says otherwise): torch's default,
    # a thread per core, makes its small host ops wait for a core the fill thread holds.
    apply_engine_threads(args.device, TORCH_THREADS.read())
    model = args.model or str(convert_default_model())
    runner_cfg = RunnerConfig(model=model, device=args.device, max_running=max(args.num_requests, 8))
    engine = Engine(runner_cfg, SchedulerConfig(overlap=args.overlap))
    tok_dir = Path(args.tokenizer) if args.tokenizer else engine.runner.model_path
    cases = [c for c in args.cases.split(",") if c and c != "none"]  # the baseline always runs
    if tok_dir is not None:
        tok = AutoTokenizer.from_pretrained(tok_dir)
        sched = engine.scheduler
        sched.grammars = GrammarBook(tok_dir, sched.vocab, tuple(sched.eos))
        prompts = [
            list(
                tok.apply_chat_template(
                    [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} as JSON."}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
            for i in range(args.num_requests)
        ]
    else:
        cases = [c for c in cases if "grammar" not in c]
        rng = random.Random(0)
        vocab = engine.runner.model_config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(40)] for _ in range(args.num_requests)]
    has_grammar = tok_dir is not None
    warm = case_params("mix" if has_grammar else "penalties", 4, 8)
    run(engine, prompts[:4], warm)  # warm-up: weights, CUDA graphs, grammar compiler, tokenizer tables
    check = overlap_check(engine, prompts[: min(16, len(prompts))], has_grammar) if args.check else None
    rounds: dict[str, list[dict]] = {"none": [], **{c: [] for c in cases}}
    for _ in range(args.rounds):
        for case in rounds:
            rounds[case].append(run(engine, prompts, case_params(case, len(prompts), args.max_tokens)))
    best = {case: max(rs, key=lambda r: r["tokens_per_s"]) for case, rs in rounds.items()}
    phases = {}
    if args.host_phases:  # after the timed rounds: the wrappers' own cost stays out of them
        for case in rounds:
            phases[case] = run(engine, prompts, case_params(case, len(prompts), args.max_tokens), True)
        for n in [int(t) for t in args.fill_threads.split(",") if t] if has_grammar else []:
            import xgrammar as xgr

            book = engine.scheduler.grammars
            default, book._batch = book._batch, xgr.BatchGrammarMatcher(max_threads=n)
            phases[f"all_grammar_fill_threads_{n}"] = run(
                engine, prompts, case_params("all_grammar", len(prompts), args.max_tokens), True
            )
            book._batch = default
    by_fill_mode = {}
    for mode in [m for m in args.fill_modes.split(",") if m] if has_grammar else []:
        undo = fill_mode(engine, mode)
        params = case_params("all_grammar", len(prompts), args.max_tokens)
        best_mode = max((run(engine, prompts, params) for _ in range(args.rounds)), key=lambda r: r["tokens_per_s"])
        timed = run(engine, prompts, params, True)
        undo()
        ratio = round(best_mode["tokens_per_s"] / best["none"]["tokens_per_s"], 3)
        by_fill_mode[mode] = {"best": best_mode, "ratio": ratio, "host_phases": timed}
        print(f"fill mode {mode}: all_grammar {best_mode['tokens_per_s']} tok/s ratio {ratio}, host {timed['host_s']}")
    by_interval = {}
    for interval in [float(t) for t in args.switch_intervals.split(",") if t]:
        # The fill thread and the scheduler's thread share the GIL: how long a thread back from xgrammar waits
        # for the other to let go is Python's switch interval (5 ms by default).
        default_interval = sys.getswitchinterval()
        sys.setswitchinterval(interval)
        rs = {
            case: max(
                (run(engine, prompts, case_params(case, len(prompts), args.max_tokens)) for _ in range(args.rounds)),
                key=lambda r: r["tokens_per_s"],
            )
            for case in rounds
        }
        sys.setswitchinterval(default_interval)
        by_interval[str(interval)] = {
            "tokens_per_s": {c: r["tokens_per_s"] for c, r in rs.items()},
            "ratios": {c: round(rs[c]["tokens_per_s"] / rs["none"]["tokens_per_s"], 3) for c in cases},
        }
        print(f"switch interval {interval * 1e3:g} ms: {by_interval[str(interval)]}")
    syncs = {}
    if args.sync_debug and args.device.startswith("cuda"):
        import warnings

        for case in rounds:
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run(engine, prompts, case_params(case, len(prompts), 16))
            torch.cuda.set_sync_debug_mode("default")
            found: dict[str, int] = {}
            for w in caught:
                where = f"{Path(w.filename).name}:{w.lineno} {str(w.message)[:60]}"
                found[where] = found.get(where, 0) + 1
            syncs[case] = found
            print(f"synchronizing ops, {case} (16 tokens): {found}")
    cprofiles = {}
    for case in [c for c in args.cprofile.split(",") if c]:
        import cProfile
        import io
        import pstats

        # Every thread's calls from Python 3.12 on (the fill thread's too: its functions show beside the
        # scheduler's); on 3.11 the scheduler's thread only.
        prof = cProfile.Profile()
        prof.enable()
        run(engine, prompts, case_params(case, len(prompts), args.max_tokens))
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
        cprofiles[case] = text.getvalue()
        print(f"cProfile, {case}:\n{cprofiles[case]}")
    for case in [c for c in args.profile.split(",") if c]:
        from torch.profiler import ProfilerActivity, profile

        on_gpu = args.device.startswith("cuda")
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
        with profile(activities=activities) as prof:
            run(engine, prompts, case_params(case, len(prompts), args.profile_tokens))
        table = prof.key_averages()
        print(f"profile, {case}: top host ops")
        print(table.table(sort_by="self_cpu_time_total", row_limit=25))
        if on_gpu:  # what the device spends its time on (a pass over [batch, vocab] shows here)
            print(f"profile, {case}: top device kernels")
            print(table.table(sort_by="self_cuda_time_total", row_limit=25))
    ratios = {c: round(best[c]["tokens_per_s"] / best["none"]["tokens_per_s"], 3) for c in cases}
    # The H200 host's rounds vary by up to 2x (a baseline round at 37k and one at 70k tok/s in one run): the
    # median of each round's ratio to the baseline of the same round resists one fast or slow round.
    paired = {
        c: round(statistics.median(r["tokens_per_s"] / n["tokens_per_s"] for r, n in zip(rounds[c], rounds["none"])), 3)
        for c in cases
    }
    out = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "model": model if args.model else "packaged",
        "tokenizer": str(tok_dir) if tok_dir is not None else None,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "overlap": engine.scheduler.overlap,
        "overlap_check": check,
        "rounds": rounds,
        "host_phases": phases,
        "synchronizing_ops": syncs,
        "switch_intervals": by_interval,
        "fill_modes": by_fill_mode,
        "cprofiles": cprofiles,
        "ratios": ratios,
        "paired_median_ratios": paired,
        "targets": {c: TARGETS[c] for c in cases},
    }
    tag = "" if not args.model else "_" + args.model.replace("dummy:", "dummy-").replace("/", "_")
    path_out = Path(args.out) if args.out else OUT_DIR / f"grammar_{args.device.split(':')[0]}{tag}.json"
    path_out.parent.mkdir(parents=True, exist_ok=True)
    path_out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"none: {best['none']['tokens_per_s']} tok/s")
    for c in cases:
        print(
            f"{c}: {best[c]['tokens_per_s']} tok/s   ratio {ratios[c]:.3f} (best of each), "
            f"{paired[c]:.3f} (median of per-round ratios) (target >= {TARGETS[c]})"
        )
    if check is not None:
        print(f"overlap on == off ({check['case']}, {check['requests']} requests): {check['identical']}")
    for case, r in phases.items():
        print(f"host phases, {case}: {r['tokens_per_s']} tok/s, seconds {r['host_s']}")
    print(f"-> {path_out}")


if __name__ == "__main__":
    main()
