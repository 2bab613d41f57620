"""A GPU worker's ready time from a fresh start with the image's prebuilt kernels (issue 49's target: <= 30 s for
an 8B worker, bf16 and FP8).

    source .devbundle/setup.sh
    python bench/worker_ready.py --build-kernels                  # once per machine: what the image's build does
    python bench/worker_ready.py [--model dummy:llama-3.1-8b] [--variants bf16,fp8] [--out bench/out/...json]

``--build-kernels`` compiles the engine's flashinfer kernels for sm_90a and sm_100a with docker/build_kernels.py
into flashinfer's prebuilt-module directory, as docker/Dockerfile.cuda does (the compile is the image build's
time, not a pod's). Each variant then starts a decode worker as a fresh pod would: a new process, an empty
flashinfer JIT workspace and an empty Triton cache (so nothing compiled by an earlier start is found; only the
prebuilt modules are), and times it from the process start to its first 200 on /ready. The worker's own
start phases (``kvferry_worker_start_phase_seconds``: process, weights, kv_pool, kernels, graphs, transfer, warm_up,
host_tier) say where the time went (``outside_phases_s``: the engine's start less its phases; ``before_engine_s``:
the ready time less the engine's start, the worker's own process), and ``compiled_at_start`` names the flashinfer modules it still
had to compile (the ones the build lacks). On an H100 (2026-12-05), before the process, kv_pool and transfer phases
existed: bf16 ready in 40.6 s, engine start 35.3 s of which the phases then named took 16.3 (weights 0.45, kernels
3.5, graphs 9.5, warm-up 2.9): ~19 s outside them.
``--logs DIR`` keeps the workers' logs there; ``--flashinfer-workspace DIR`` starts on kernels compiled earlier
(a JIT workspace such as the bundle's) where the image's set is not built, for the other phases.
``--archs "9.0a" --head-dims 128 --mla ""`` builds the image's set for an 8B model on an H200 only (no latent-attention
modules), in a fraction of the time.
Variants: ``bf16`` (16-bit weights and KV), ``fp8`` (KVFERRY_WEIGHT_DTYPE and KVFERRY_KV_DTYPE fp8_e4m3).
Writes JSON (the ready seconds, the target, their ratio, the phases) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.devcluster.process import worker_process  # noqa: E402
from common.devcluster.redis_server import redis_server, wait_redis  # noqa: E402
from common.net import free_port  # noqa: E402

TARGET_S = 30.0
ARCHS = "9.0a 10.0a"  # what docker/Dockerfile.cuda builds for
VARIANTS = {
    "bf16": {},
    "fp8": {"KVFERRY_WEIGHT_DTYPE": "fp8_e4m3", "KVFERRY_KV_DTYPE": "fp8_e4m3"},
}


def build_kernels(archs: str, shapes: list[str]) -> None:
    env = {**os.environ, "FLASHINFER_CUDA_ARCH_LIST": archs}
    env["FLASHINFER_WORKSPACE_BASE"] = tempfile.mkdtemp(prefix="kvferry-kernel-build-")
    subprocess.run([sys.executable, str(REPO / "docker" / "build_kernels.py"), *shapes], env=env, check=True)


def compiled_at_start(workspace: Path) -> list[str]:
    """The flashinfer modules the start compiled itself: those the prebuilt set lacks."""
    return sorted(p.parent.name for p in workspace.glob("**/cached_ops/*/*.so"))


def start_phases(url: str) -> tuple[dict[str, float], float]:
    phases, total = {}, 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "kvferry_worker_start_phase_seconds":
                phases[s.labels["phase"]] = round(s.value, 2)
            elif s.name == "kvferry_worker_start_seconds":
                total = round(s.value, 2)
    return phases, total


def ready_time(
    name: str,
    model: str,
    device: str,
    extra: dict[str, str],
    redis_url: str,
    logs: Path,
    timeout_s: float,
    workspace: Path | None = None,
) -> dict:
    port = free_port()
    fresh = Path(tempfile.mkdtemp(prefix=f"kvferry-fresh-{name}-"))
    kernels = workspace or fresh / "flashinfer"
    env = {
        **os.environ,
        "KVFERRY_MODEL": model,
        "KVFERRY_DEVICE": device,
        "KVFERRY_POD_NAME": f"ready-{name}",
        "KVFERRY_LOG_LEVEL": "INFO",  # the start phases' lines in the log
        "FLASHINFER_WORKSPACE_BASE": str(kernels),
        "TRITON_CACHE_DIR": str(fresh / "triton"),
        **extra,
    }
    env.pop("FLASHINFER_CUDA_ARCH_LIST", None)  # a pod's environment: the image sets none
    part = worker_process("decode", port, redis_url, env, logs / f"{name}.log", name=name)
    started = time.monotonic()
    part.start()
    try:
        with httpx.Client(timeout=2.0) as client:
            while True:
                if not part.alive():
                    raise RuntimeError(f"{name}: the worker exited during start:\n{part.log_tail()}")
                if time.monotonic() - started > timeout_s:
                    raise RuntimeError(f"{name}: not ready after {timeout_s:.0f} s:\n{part.log_tail()}")
                try:
                    if client.get(f"{part.url}/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        ready_s = time.monotonic() - started
        phases, engine_s = start_phases(part.url)
    finally:
        part.stop()
    return {
        "ready_s": round(ready_s, 2),
        "compiled_at_start": compiled_at_start(kernels) if workspace is None else None,
        "target_s": TARGET_S,
        "ready_over_target": round(ready_s / TARGET_S, 3),
        "engine_start_s": engine_s,
        "phases_s": phases,
        "outside_phases_s": round(engine_s - sum(phases.values()), 2),
        "before_engine_s": round(ready_s - engine_s, 2),
        "settings": extra,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-kernels", action="store_true", help="compile the kernels as the image does, then stop")
    ap.add_argument("--archs", default=ARCHS, help="--build-kernels: FLASHINFER_CUDA_ARCH_LIST (the image's default)")
    ap.add_argument("--head-dims", default="", help="--build-kernels: docker/build_kernels.py's (empty: its default)")
    ap.add_argument(
        "--mla", default=None, help='--build-kernels: docker/build_kernels.py\'s latent-attention shapes ("": none)'
    )
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--variants", default="bf16,fp8")
    ap.add_argument("--device", default="cuda", help="cpu: the harness alone (bf16 there means the CPU default)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take before it counts as failed")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "worker_ready.json")
    ap.add_argument("--logs", type=Path, default=None, help="the workers' logs here (default: a new temporary folder)")
    ap.add_argument(
        "--flashinfer-workspace",
        type=Path,
        default=None,
        help="start on this JIT workspace (kernels compiled earlier) instead of a fresh one: for the start's other "
        "phases where the image's kernels are not at hand; `compiled_at_start` is then not reported",
    )
    args = ap.parse_args()
    if args.build_kernels:
        shapes = ["--head-dims", args.head_dims] if args.head_dims else []
        build_kernels(args.archs, shapes + (["--mla", args.mla] if args.mla is not None else []))
        return 0
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvferry-ready-"))
    logs.mkdir(parents=True, exist_ok=True)
    redis = redis_server(free_port(), logs / "redis.log")
    redis.start()
    out: dict = {"model": args.model, "logs": str(logs), "variants": {}}
    try:
        wait_redis(redis)
        for name in args.variants.split(","):
            out["variants"][name] = ready_time(
                name,
                args.model,
                args.device,
                VARIANTS[name],
                redis.url or "",
                logs,
                args.timeout,
                args.flashinfer_workspace,
            )
            print(json.dumps({name: out["variants"][name]}), flush=True)
    finally:
        redis.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
