"""The `kvferry` command."""

from __future__ import annotations

import argparse
import importlib
import sys

from common.log import setup_logging

# What each command does, for `kvferry --help` (and the README's table).
COMMANDS = {
    "up": "the whole system on this machine: Redis, a router, prefill and decode workers (Ctrl-C stops it)",
    "router": "the OpenAI front end: tokenizes, admits and places requests on workers",
    "prefill": "a prefill worker: chunked prefill over a prefix cache, KV pushed to decode workers over NIXL",
    "decode": "a decode worker: continuous-batching decode over a paged KV cache (prefills short prompts too)",
    "mixed": "a worker that decodes, prefills its own prompts and prefills for its peers",
    "planner": "sizes the prefill, decode and mixed Deployments to the SLOs from the routers' metrics",
    "generate": "complete one prompt offline, without a server",
    "convert-default-model": "convert the embedded GGUF model once into the cache (KVFERRY_CACHE_DIR)",
}

# Roles run in packages that `common` must not import at module level; they are resolved by name. The worker
# roles share one entry point (common/worker/main.py), which takes the role.
_ROLE_MAINS = {
    "router": "router.main",
    "planner": "planner.main",
    "up": "common.devcluster.up",
}
_WORKER_ROLES = ("prefill", "decode", "mixed")


def _generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvferry generate", description="Complete one prompt offline.")
    p.add_argument("prompt")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template first")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    from common.offline import Engine
    from common.protocol import DecodeError, SamplingParams, convert
    from common.settings import RunnerConfig

    try:  # the command line is this process's edge: its values are checked like a request's
        fields = {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed,
        }
        sp = convert(fields, SamplingParams)
    except DecodeError as e:
        p.error(str(e))
    engine = Engine(RunnerConfig(model=args.model, device=args.device, kv_memory_gb=0.25))
    result = engine.generate([args.prompt], sp, chat=args.chat)[0]
    print(result.text)
    return 0


def _convert(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvferry convert-default-model")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    from common.default_model import convert_default_model

    print(convert_default_model(force=args.force))
    return 0


def _usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, what in COMMANDS.items())
    return (
        "usage: kvferry COMMAND [options]   (kvferry COMMAND --help for its options)\n\ncommands:\n"
        f"{rows}\n\nSettings come from KVFERRY_* environment variables (docs/architecture.md); flags override."
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(_usage(), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    setup_logging()
    cmd, rest = argv[0], argv[1:]
    if cmd == "generate":
        return _generate(rest)
    if cmd == "convert-default-model":
        return _convert(rest)
    if cmd in _WORKER_ROLES:
        from common.worker.main import main as worker_main

        return worker_main(cmd, rest)
    return int(importlib.import_module(_ROLE_MAINS[cmd]).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
