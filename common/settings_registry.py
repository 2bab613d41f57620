"""One file because it is the registry: every setting kvferry reads from the environment, declared in one place.

Each `KVFERRY_*` setting is declared once: name, type, default, what it does, which component reads it and where.

Config dataclasses bind a field to a declaration (`page_size: int = PAGE_SIZE.field()`): the field's default is
the declared one, `read_fields` fills the fields from the environment, `add_flags` gives the commands their
flags, and `render_table` writes the table in docs/architecture.md (`python -m common.settings_registry
--write-docs`; tests/test_settings_registry.py checks it is current). Settings read outside a dataclass are read
with `SETTING.read()`. Adding a setting is one `declare(...)` here plus the field (or `.read()`) that uses it.

An empty (or blank) value counts as unset. Standard library only: the router imports this, and it never loads torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Self, TypeVar, get_origin, get_type_hints

from common.slo import DEFAULT_SLO_SPEC, parse_slo_classes

__all__ = ["REGISTRY", "EnvFields", "Setting", "add_flags", "declare", "read_fields", "rebuilt", "render_table"]

T = TypeVar("T")
_META = "kvferry_setting"  # the dataclass field metadata key that binds a field to its Setting

# What a setting is for; the docs list each kind in its own table. Manifests may set only "setting" and "debug".
KINDS = ("setting", "debug", "internal", "test")


@dataclass(frozen=True)
class Setting(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    doc: str  # what it does (the docs table)
    who: str  # which component reads it: "all", "workers", "router", "GPU workers", ...
    read_in: str  # the module that reads it (the docs table; a test checks it names the setting)
    shown_default: str = ""  # the docs' default cell, where the value alone does not say it
    flag: bool = False  # also a flag (`flag_name`) of the commands whose config binds it
    choices: tuple[str, ...] = ()  # the flag's allowed values
    kind: str = "setting"

    @property
    def flag_name(self) -> str:
        """`--page-size` for KVFERRY_PAGE_SIZE, `--max-inflight` for KVFERRY_ROUTER_MAX_INFLIGHT."""
        return "--" + self.name.removeprefix("KVFERRY_").removeprefix("ROUTER_").lower().replace("_", "-")

    def raw(self, environ: Mapping[str, str] | None = None) -> str:
        return (os.environ if environ is None else environ).get(self.name, "")

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return bool(self.raw(environ).strip())

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        raw = self.raw(environ)
        if not raw.strip():
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None

    def field(self, default: Any = dataclasses.MISSING) -> Any:
        """A dataclass field bound to this setting, with its default (`default` only where the reader's differs,
        as a port that is the role's)."""
        meta = {_META: self}
        value = self.default if default is dataclasses.MISSING else default
        if isinstance(value, list):
            items = list(value)
            return dataclasses.field(default_factory=lambda: list(items), metadata=meta)
        return dataclasses.field(default=value, metadata=meta)

    def default_cell(self) -> str:
        if self.shown_default:
            return self.shown_default
        value = self.default
        if value is None or value == "" or value == []:
            return "unset"
        if isinstance(value, bool):
            return "`1`" if value else "`0`"
        return f"`{value}`" if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)


REGISTRY: dict[str, Setting[Any]] = {}


def declare(
    name: str, parse: Callable[[str], T], default: T, doc: str, who: str, read_in: str, **extra: Any
) -> Setting[T]:
    assert name.startswith("KVFERRY_") and name not in REGISTRY, name
    setting = Setting(name, parse, default, doc, who, read_in, **extra)
    assert setting.kind in KINDS, setting.kind
    REGISTRY[name] = setting
    return setting


def binding(f: dataclasses.Field[Any]) -> Setting[Any] | None:
    return f.metadata.get(_META)


C = TypeVar("C")


def rebuilt(cls: type[C], data: Mapping[str, Any]) -> C:
    """A config dataclass back from `dataclasses.asdict` after a JSON round trip (how a parent process hands its
    resolved settings to its children): nested config dataclasses and tuples are rebuilt, not left dicts and lists."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init or f.name not in data:
            continue
        value, hint = data[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            value = rebuilt(hint, value)  # type: ignore[arg-type]
        elif get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    return cls(**values)


def read_fields(cls: type, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The fields of dataclass `cls` whose settings are set in the environment, parsed (kwargs for `cls`)."""
    values = {}
    for f in dataclasses.fields(cls):
        setting = binding(f)
        if setting is not None and setting.is_set(environ):
            values[f.name] = setting.read(environ)
    return values


class EnvFields:
    """Base of a config dataclass read whole from the environment: `from_env` fills the fields bound to settings."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        return cls(**read_fields(cls, environ))


def add_flags(parser: argparse._ActionsContainer, *classes: type, dest_prefix: str = "") -> None:
    """The flag of every field of `classes` bound to a setting declared with `flag=True` (dest: the field's name
    after `dest_prefix`; unset flags stay None, so the environment's value stands)."""
    for cls in classes:
        for f in dataclasses.fields(cls):
            setting = binding(f)
            if setting is None or not setting.flag:
                continue
            parser.add_argument(
                setting.flag_name,
                dest=dest_prefix + f.name,
                type=setting.parse,
                choices=setting.choices or None,
                help=_plain(f"{setting.doc} (env {setting.name}; default {setting.default_cell()})"),
            )


def _plain(markdown: str) -> str:
    return markdown.replace("`", "").replace("%", "%%")


# ---- parsers ------------------------------------------------------------------------------------------------


def on_off(value: str) -> bool:
    """`0` / `off` / `false` (any case) turn a switch off; anything else leaves it on."""
    return value.strip().lower() not in ("0", "off", "false")


def auto_on_off(value: str) -> str:
    """`auto`, `on` or `off` (any case); anything else is refused when the setting is read."""
    choice = value.strip().lower()
    if choice not in ("auto", "on", "off"):
        raise ValueError("must be auto, on or off")
    return choice


def only_one(value: str) -> bool:
    """Debug switches: on only when exactly `1`."""
    return value.strip() == "1"


def url_list(value: str) -> list[str]:
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]


def token_list(value: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in value.split(",") if t.strip())


# `SchedulerConfig.itl_target_ms` below 0: the target is -itl_target_ms times the engine's own measured
# decode step; `auto` is 2 of them (common/sched/prefill_budget.py).
ITL_TARGET_AUTO = -2.0
# The default: the tightest ITL target of the SLO classes being decoded (common/slo.py), at least two decode steps.
ITL_TARGET_SLO = math.inf


def itl_target_ms(value: str) -> float:
    """`slo` (ITL_TARGET_SLO), `auto` (ITL_TARGET_AUTO), `<k>x` (k of the engine's measured decode steps, k >= 1),
    milliseconds, or 0 (prefill-first)."""
    text = value.strip().lower()
    if text == "slo":
        return ITL_TARGET_SLO
    if text == "auto":
        return ITL_TARGET_AUTO
    if text.endswith("x"):
        steps = float(text[:-1])
        if steps < 1:
            raise ValueError("a multiple of the decode step must be at least 1x")
        return -steps
    ms = float(text)
    if ms < 0:
        raise ValueError("must be auto, <k>x, 0 or a positive number of ms")
    return ms


def milliseconds(value: str) -> float:
    """A duration in ms, 0 or more."""
    ms = float(value)
    if not ms >= 0:
        raise ValueError("must be 0 or a positive number of ms")
    return ms


def key_prefix(value: str) -> str:
    prefix = value.strip()
    if any(c.isspace() for c in prefix):
        raise ValueError("must not contain spaces")
    return prefix


def gib_or_auto(value: str) -> float:
    """`auto` is -1 (chosen at start); else GiB."""
    return -1.0 if value.strip().lower() == "auto" else float(value)


# ---- all components -------------------------------------------------------------------------------------------
MODEL = declare(
    "KVFERRY_MODEL",
    str,
    "smollm2-135m-instruct",
    "served model: the embedded default's name, a local HF directory, or `dummy:<named config>` (tests)",
    "all",
    "common/settings.py, common/config.py, common/devcluster/up.py",
    shown_default="`smollm2-135m-instruct` (the embedded default)",
    flag=True,
)
RELAY_ALLOWANCE = declare(
    "KVFERRY_RELAY_ALLOWANCE",
    on_off,
    True,
    "the router and each decode worker measure how late their event loop runs what is due (the p99 over the last "
    "~5 s: how late they relay a step's tokens to the streams they reach last, `common/loop_lag.py`) and add it to "
    "each request's ITL allowance: its steps aim that much under the class's ITL target (at most 20% of it; "
    "`KVFERRY_ITL_DELIVERY_MS` the least)",
    "all",
    "common/config.py",
)
HOST = declare("KVFERRY_HOST", str, "0.0.0.0", "address to listen on", "all", "common/config.py", flag=True)
PORT = declare(
    "KVFERRY_PORT",
    int,
    0,
    "port to listen on",
    "all",
    "common/config.py",
    shown_default="the role's (router 8000, prefill 8100, decode 8200, mixed 8300)",
    flag=True,
)
REDIS_URL = declare(
    "KVFERRY_REDIS_URL",
    str,
    "redis://127.0.0.1:6379/0",
    "the prefix index's Redis; `rediss://` = TLS; may carry `user:password@`",
    "all",
    "common/config.py",
    flag=True,
)
REDIS_PASSWORD: Setting[str | None] = declare(
    "KVFERRY_REDIS_PASSWORD",
    str,
    None,
    "Redis AUTH password, kept out of the URL (from a Secret in k8s: docs/kubernetes.md; a password in the URL wins)",
    "all",
    "common/prefix/access.py, common/devcluster/redis_server.py",
)
REDIS_USERNAME: Setting[str | None] = declare(
    "KVFERRY_REDIS_USERNAME", str, None, "Redis ACL user for the password", "all", "common/prefix/access.py"
)
REDIS_TLS_CA: Setting[str | None] = declare(
    "KVFERRY_REDIS_TLS_CA",
    str,
    None,
    "CA file that verifies a `rediss://` server",
    "all",
    "common/prefix/access.py",
    shown_default="unset = the system's CAs",
)
REDIS_TLS_CERT: Setting[str | None] = declare(
    "KVFERRY_REDIS_TLS_CERT",
    str,
    None,
    "client certificate for a `rediss://` server that asks for one",
    "all",
    "common/prefix/access.py",
)
REDIS_TLS_KEY: Setting[str | None] = declare(
    "KVFERRY_REDIS_TLS_KEY", str, None, "the client certificate's key", "all", "common/prefix/access.py"
)
REDIS_PREFIX = declare(
    "KVFERRY_REDIS_PREFIX",
    key_prefix,
    "kvf",
    "first part of every Redis key: two deployments share one Redis under different prefixes",
    "all",
    "common/prefix/access.py",
)
INTERNAL_TOKEN = declare(
    "KVFERRY_INTERNAL_TOKEN",
    token_list,
    (),
    "required as `Authorization: Bearer` on the workers' `/internal/*` (else 401) and sent by the router and "
    "decode/mixed workers on every internal call; comma-separated: the first is sent, any is accepted (rotation)",
    "all",
    "common/internal_auth.py, common/devcluster/up.py",
    shown_default="unset = the internal API is open",
)
LOG_LEVEL = declare(
    "KVFERRY_LOG_LEVEL", str, "WARNING", "log level (`DEBUG` logs a timeline per request)", "all", "common/log.py"
)
CACHE_DIR = declare(
    "KVFERRY_CACHE_DIR",
    str,
    "",
    "where the converted default model is kept",
    "all",
    "common/default_model.py",
    shown_default="`$XDG_CACHE_HOME/kvferry` or `~/.cache/kvferry`",
)
API_KEY: Setting[str | None] = declare(
    "KVFERRY_API_KEY",
    str,
    None,
    "require `Authorization: Bearer <key>` on `/v1/*` (and `/debug/*`); unset: no auth",
    "router",
    "common/config.py, common/devcluster/up.py",
    flag=True,
)

# ---- workers: identity and lifecycle ---------------------------------------------------------------------------
ADVERTISE_URL = declare(
    "KVFERRY_ADVERTISE_URL",
    str,
    "",
    "the URL the router and peers call this worker at",
    "workers",
    "common/config.py",
    shown_default="`http://<host>:<port>` (127.0.0.1 for 0.0.0.0)",
    flag=True,
)
PREFILL_PEERS = declare(
    "KVFERRY_PREFILL_PEERS",
    url_list,
    [],
    "the prefill and mixed workers a decode or mixed worker may ask for remote prefills, comma-separated URLs: a "
    "host name stands for every address it resolves to (a headless Service), a URL without a port for every "
    "port of its host; a request naming another is refused (403 `unknown_prefill_peer`)",
    "workers",
    "common/config.py",
    shown_default="none (`kvferry up` and the manifests set it)",
)
POD_NAME = declare(
    "KVFERRY_POD_NAME",
    str,
    "",
    "the worker's identity in Redis",
    "workers",
    "common/config.py",
    shown_default="`<hostname>-<role>-<port>`",
    flag=True,
)
DRAIN_SECONDS = declare(
    "KVFERRY_DRAIN_SECONDS", float, 25.0, "graceful drain on SIGTERM, seconds", "workers", "common/config.py"
)
ENGINE_RESTARTS = declare(
    "KVFERRY_ENGINE_RESTARTS",
    int,
    3,
    "failed engine restarts in a row before the worker exits (code 4; docs/reliability.md)",
    "workers",
    "common/config.py",
)
ENGINE_START_TIMEOUT_S = declare(
    "KVFERRY_ENGINE_START_TIMEOUT_S",
    float,
    600.0,
    "a restarted engine not ready in this long is killed and counts as failed",
    "workers",
    "common/config.py",
)


def _share(value: str) -> float:
    """A fraction in (0, 1]."""
    share = float(value)
    if not 0 < share <= 1:
        raise ValueError("must be in (0, 1]")
    return share


MAX_REQUEST_KV_SHARE = declare(
    "KVFERRY_MAX_REQUEST_KV_SHARE",
    _share,
    0.5,
    "the most of a decode worker's KV pool one request may reserve (all its choices: n x (prompt + max_tokens)), "
    "and it is admitted only while as much again stays free (docs/reliability.md); the worker publishes it in /load "
    "and refuses larger requests (400); 1 = the whole pool",
    "workers",
    "common/config.py",
    flag=True,
)
TORCH_THREADS = declare(
    "KVFERRY_TORCH_THREADS",
    int,
    0,
    "engine process CPU threads (`common/engine/threads.py`)",
    "workers",
    "common/worker/engine_loop.py, common/engine/tp_follower.py",
    shown_default="0 = chosen by the engine: 4 for a GPU engine, every usable core (affinity, cgroup CPU quota) "
    "for a CPU engine",
)

# ---- workers: engine -------------------------------------------------------------------------------------------
DEVICE = declare(
    "KVFERRY_DEVICE",
    str,
    "cpu",
    "`cpu` or `cuda[:N]`",
    "workers",
    "common/settings.py",
    shown_default="`cpu` (`cuda` on GPU images)",
    flag=True,
)
DTYPE = declare(
    "KVFERRY_DTYPE",
    str,
    "auto",
    "`auto` = float32 on the CPU, bfloat16 on a GPU; `float32` on a GPU runs the torch path (no flashinfer, no "
    "CUDA graphs): the reference for telling a bf16 near-tie from a bug",
    "workers",
    "common/settings.py",
)
KV_DTYPE = declare(
    "KVFERRY_KV_DTYPE",
    str,
    "auto",
    "KV cache format: `auto` = the model's dtype; `fp8_e4m3` = float8 e4m3 pages (half the bytes of bf16 per "
    "token, in the pool, over NIXL and in the host tier) with one static scale per layer for K and one for V "
    "(the checkpoint's `k_scale` / `v_scale`, else 1.0); a prefill and a decode worker must agree",
    "workers",
    "common/settings.py",
    choices=("auto", "fp8_e4m3"),
)
WEIGHT_DTYPE = declare(
    "KVFERRY_WEIGHT_DTYPE",
    str,
    "auto",
    "linear-layer weights: `auto` = as the checkpoint stores them (an FP8 checkpoint, compressed-tensors or "
    "`quant_method: fp8` with per-tensor or 128 x 128 block scales, loads as FP8; anything else in "
    "`KVFERRY_DTYPE`); `fp8_e4m3` = quantized at load to float8 e4m3 with one scale per "
    "output channel, activations scaled per token as each GEMM runs; embeddings, norms and the LM head keep "
    "`KVFERRY_DTYPE`",
    "workers",
    "common/settings.py",
    choices=("auto", "fp8_e4m3"),
)
PAGE_SIZE = declare("KVFERRY_PAGE_SIZE", int, 16, "tokens per KV page", "workers", "common/settings.py", flag=True)
NUM_PAGES = declare(
    "KVFERRY_NUM_PAGES",
    int,
    0,
    "KV pages per worker; 0 = sized from `KVFERRY_KV_MEMORY_GB`",
    "workers",
    "common/settings.py",
    flag=True,
)
KV_MEMORY_GB = declare(
    "KVFERRY_KV_MEMORY_GB",
    float,
    0.0,
    "GiB of KV pages; 0 = chosen at start: GPU memory free after the weights minus max(4 GiB, 8%) "
    "(`common/engine/kv_sizing.py`), 1 GiB on the CPU",
    "workers",
    "common/settings.py",
    flag=True,
)
MAX_RUNNING = declare(
    "KVFERRY_MAX_RUNNING",
    int,
    64,
    "batch slots (requests decoding at once); 0 = by device",
    "workers",
    "common/settings.py",
    shown_default="256 on a GPU, 64 on the CPU",
    flag=True,
)
MAX_SEQ_LEN = declare(
    "KVFERRY_MAX_SEQ_LEN",
    int,
    0,
    "longest sequence (prompt + output) a request may reach; 0 = the model's context length",
    "workers",
    "common/settings.py",
    flag=True,
)
ATTENTION = declare(
    "KVFERRY_ATTENTION",
    str,
    "auto",
    "attention backend: `auto` = flashinfer on CUDA with a 16-bit dtype, else torch; `torch` / `flashinfer` force it",
    "workers",
    "common/settings.py",
    choices=("auto", "torch", "flashinfer"),
)
CUDA_GRAPH_MAX_BS = declare(
    "KVFERRY_CUDA_GRAPH_MAX_BS",
    int,
    -1,
    "decode CUDA graphs up to this batch; -1 = `KVFERRY_MAX_RUNNING`, 0 = none",
    "GPU workers",
    "common/settings.py",
)
CUDA_GRAPH_MAX_TOKENS = declare(
    "KVFERRY_CUDA_GRAPH_MAX_TOKENS",
    int,
    2560,
    "prefill and mixed steps of up to this many tokens (prompt tokens and decode rows) run as piecewise CUDA graphs "
    "(all but attention); 0 = eager. 2560: the default chunk of 2,048 prompt tokens with up to 512 decode rows "
    "beside it (eager chunk steps of 512-1,536 tokens ran up to 150 ms past the step model with FP8; a full chunk "
    "beside decode rows, eager at a limit of 2,048, took 40 ms of host launches at p50 with FP8, 14 graphed)",
    "GPU workers",
    "common/settings.py",
)
DECODE_TC_MIN_BS = declare(
    "KVFERRY_DECODE_TC_MIN_BS",
    int,
    1,
    "decode batches below it use CUDA-core attention (1: tensor cores always)",
    "GPU workers",
    "common/settings.py",
)
FUSED_KERNELS = declare(
    "KVFERRY_FUSED_KERNELS",
    on_off,
    True,
    "the Triton kernels (see GPU kernels); `0` = flashinfer + cuBLAS only",
    "GPU workers",
    "common/settings.py",
)
MLA_DECOMPRESSED_PREFILL = declare(
    "KVFERRY_MLA_DECOMPRESSED_PREFILL",
    on_off,
    False,
    "latent attention on flashinfer: eager steps' prompt chunks with no cached prefix attend decompressed (keys "
    "and values expanded through `kv_b_proj`, flashinfer's ragged prefill); off (absorbed for every step) until "
    "checked on a GPU. Steps up to `KVFERRY_CUDA_GRAPH_MAX_TOKENS` are graphed, absorbed: lower it (512) with this on",
    "GPU workers",
    "common/settings.py",
)
PDL = declare(
    "KVFERRY_PDL",
    on_off,
    True,
    "Hopper and later: the GPU kernels launch as programmatic dependent launches (each starts while the one "
    "before finishes); `0` = plain launches",
    "GPU workers",
    "common/settings.py",
)
GEMV_MAX_ROWS = declare(
    "KVFERRY_GEMV_MAX_ROWS",
    int,
    8,
    "steps of at most this many rows run their GEMMs as Triton GEMVs; 0 = never",
    "GPU workers",
    "common/settings.py",
)
TP_SIZE = declare(
    "KVFERRY_TP_SIZE",
    int,
    1,
    "tensor-parallel ranks, one process each (GPU: one GPU each)",
    "workers",
    "common/settings.py",
    flag=True,
)
TP_TRANSFER = declare(
    "KVFERRY_TP_TRANSFER",
    str,
    "auto",
    "how peers reach the ranks' KV (see Tensor parallelism): `shared`, `per-rank`, `auto` = by device",
    "workers",
    "common/settings.py",
    shown_default="`auto` (`shared` on CPU, `per-rank` on GPU)",
)

# ---- workers: scheduling and KV --------------------------------------------------------------------------------
MAX_PREFILL_TOKENS = declare(
    "KVFERRY_MAX_PREFILL_TOKENS",
    int,
    2048,
    "prompt tokens per step (the chunk budget)",
    "workers",
    "common/settings.py",
    flag=True,
)
ITL_DELIVERY_MS = declare(
    "KVFERRY_ITL_DELIVERY_MS",
    milliseconds,
    0.0,
    "with `KVFERRY_ITL_TARGET_MS=slo`: the least part of each class's ITL target left to the path after the engine "
    "(the worker's and the router's relay, the network; the router's measured relay lateness may raise it, "
    "`KVFERRY_RELAY_ALLOWANCE`): steps beside decoding aim at the target less this (at most 20% of it), so a "
    "request's own ITL p99 as its client measures it stays within the target",
    "workers",
    "common/settings.py",
)
GRAMMAR_COMPILE_TIMEOUT_S = declare(
    "KVFERRY_GRAMMAR_COMPILE_TIMEOUT_S",
    float,
    10.0,
    "a request's grammar (structured output) not compiled within this long fails that request alone; grammars "
    "compile on a worker thread, never in the engine's step loop",
    "workers",
    "common/settings.py",
)
MAX_STEP_MS = declare(
    "KVFERRY_MAX_STEP_MS",
    float,
    1000.0,
    "the longest step the engine plans (its step-time model's prediction): commands, aborts and load reports are "
    "read between steps, so this bounds how long they wait; 0 = no bound",
    "workers",
    "common/settings.py",
)
ITL_TARGET_MS = declare(
    "KVFERRY_ITL_TARGET_MS",
    itl_target_ms,
    ITL_TARGET_SLO,
    "`slo` = the tightest ITL target of the SLO classes being decoded (at least 2 decode steps); N = ms; `<k>x` = k "
    "measured decode steps; 0 = prefill-first. Every step decodes every running request and takes the largest prompt "
    "chunk whose step the engine's fitted step-time model predicts within the target (at least 4 pages; "
    "`common/sched/prefill_budget.py`, "
    '"Stall-free batching" above): bounds the ITL a prompt\'s prefill costs a running stream',
    "workers",
    "common/settings.py",
    shown_default="`slo`",
)


KV_RESERVATION = declare(
    "KVFERRY_KV_RESERVATION",
    str,
    "full",
    "KV pages an admitted request reserves: `full` = its prompt and all of max_tokens (nothing is ever preempted); "
    "`optimistic` = its prompt and a small decode allowance, growing page by page; when the pool runs out the "
    "lowest-class, latest-deadline running request is preempted and recomputed later, its output unchanged "
    "(grammar requests reserve in full). `common/sched/pages.py`",
    "workers",
    "common/settings.py",
    choices=("full", "optimistic"),
)
PREEMPT_MODE = declare(
    "KVFERRY_PREEMPT_MODE",
    str,
    "auto",
    "What a preempted request's KV becomes (optimistic reservation): `recompute` = freed, its prompt and outputs "
    "prefilled again on readmission; `park` = copied to the host KV tier and copied back on readmission, nothing "
    "recomputed (the worker refuses to start without a host tier; a request the tier cannot hold is recomputed); "
    "`auto` = park when the worker has a host tier, else recompute. `common/sched/pages.py`",
    "workers",
    "common/settings.py",
    choices=("auto", "recompute", "park"),
)
STACK_SAMPLES = declare(
    "KVFERRY_STACK_SAMPLES",
    str,
    "",
    "a file the engine process appends its main thread's stack to every millisecond while it works on the host "
    "(collapsed flame-graph lines with a wall clock: why a step's launch took long, `common/observability/"
    "stack_samples.py`); a diagnostic that costs a little of every step; empty = off",
    "workers",
    "common/worker/engine_host.py",
)
STEP_TRACE = declare(
    "KVFERRY_STEP_TRACE",
    str,
    "",
    "a JSON-lines file each timed engine step is appended to: its kind, prompt tokens, decode rows, their context, "
    "device seconds, the gap its streams saw, the step model's prediction and the ITL target (what the step-time "
    "model is fitted to, for diagnosing a budget; `common/sched/step_trace.py`); empty = off",
    "workers",
    "common/settings.py",
)


def slo_spec(value: str) -> str:
    """A KVFERRY_SLO_CLASSES spec, checked (common/slo.py) and written back in its canonical form."""
    return parse_slo_classes(value).spec()


SLO_CLASSES = declare(
    "KVFERRY_SLO_CLASSES",
    slo_spec,
    DEFAULT_SLO_SPEC,
    "the request classes and their targets, highest priority first: `name:ttft=<time|none>,itl=<time>,p=<percentile>;...` "
    "(`common/slo.py`; SLOs above). Workers size steps to the tightest ITL target of the requests they decode and "
    "queue prompts by TTFT deadline; the router maps `priority` / `x-kvferry-class` to a class",
    "all",
    "common/settings.py, common/config.py",
)
SLO_DEFAULT_CLASS = declare(
    "KVFERRY_SLO_DEFAULT_CLASS",
    str,
    "",
    "the class of a request that names none",
    "all",
    "common/settings.py, common/config.py",
    shown_default="the first declared class",
)
HOST_KV_GB = declare(
    "KVFERRY_HOST_KV_GB",
    gib_or_auto,
    -1.0,
    "GiB of host memory behind the prefix cache (see Host KV tier); 0 = off",
    "workers",
    "common/settings.py",
    shown_default="`auto` = 30% of the host memory the worker may use on a GPU, none on the CPU",
    flag=True,
)
OVERLAP = declare(
    "KVFERRY_OVERLAP",
    str,
    "auto",
    "`auto` = the host schedules step N+1 while step N runs on a GPU at TP=1, off otherwise; `on` / `off` force it "
    "(`on` runs the GPU loop's shape on the CPU: tests)",
    "workers",
    "common/settings.py",
)

# ---- workers: transfer -----------------------------------------------------------------------------------------
TRANSFER_STAGING_MB = declare(
    "KVFERRY_TRANSFER_STAGING_MB",
    float,
    256.0,
    "packing area for peers whose ranks split KV heads differently",
    "workers",
    "common/config.py",
)
WARM_UP = declare(
    "KVFERRY_WARM_UP",
    auto_on_off,
    "auto",
    "run a small synthetic workload through the engine before the worker is ready, so its first users do not "
    "wait for kernels to compile (`common/sched/warm_up.py`): `auto` = on a GPU, `on`, `off`",
    "workers",
    "common/config.py",
)
NIXL_PROGRESS_DELAY_US = declare(
    "KVFERRY_NIXL_PROGRESS_DELAY_US",
    int,
    -1,
    "NIXL progress-thread sleep; 0 = busy loop",
    "workers",
    "common/config.py",
    shown_default="-1 = 100 on CPU pools, 0 on GPU pools",
)

# ---- router ----------------------------------------------------------------------------------------------------
DISCOVERY = declare(
    "KVFERRY_DISCOVERY",
    str,
    "static",
    "how the router finds workers: `static` (the URL lists) or `k8s` (pods by label)",
    "router",
    "common/config.py",
    flag=True,
    choices=("static", "k8s"),
)
PREFILL_URLS = declare(
    "KVFERRY_PREFILL_URLS",
    url_list,
    [],
    "prefill worker URLs, comma-separated (static discovery)",
    "router",
    "common/config.py",
    flag=True,
)
DECODE_URLS = declare(
    "KVFERRY_DECODE_URLS",
    url_list,
    [],
    "decode worker URLs, comma-separated (static discovery)",
    "router",
    "common/config.py",
    flag=True,
)
MIXED_URLS = declare(
    "KVFERRY_MIXED_URLS",
    url_list,
    [],
    "mixed worker URLs (prefill for peers and decode), comma-separated (static discovery)",
    "router",
    "common/config.py",
    flag=True,
)
NAMESPACE = declare(
    "KVFERRY_NAMESPACE",
    str,
    "",
    "the namespace k8s discovery watches",
    "router",
    "common/config.py",
    shown_default="from the service-account file, else `default`",
    flag=True,
)


def _router(name: str, parse: Callable[[str], T], default: T, doc: str, **extra: Any) -> Setting[T]:
    """A router-only option: `KVFERRY_ROUTER_<NAME>`, flag `--<name>` of `kvferry router`."""
    return declare(
        f"KVFERRY_ROUTER_{name.upper()}", parse, default, doc, "router", "router/settings.py", flag=True, **extra
    )


ROUTER_TOKENIZER = _router(
    "tokenizer", str, "", "tokenizer directory when the model id is not one (e.g. `dummy:` workers)"
)
ROUTER_WORKERS = _router(
    "workers",
    int,
    1,
    "router processes in this pod, sharing its port (what one streams: bench/RESULTS.md, 'Router streaming capacity'); each has its own worker pool, "
    "polls, in-flight counts and admission, and they share the prefix index in Redis",
    shown_default="1 (the k8s router sets its CPU limit)",
)
ROUTER_EVENT_LOOP = _router(
    "event_loop", str, "auto", "uvicorn's event loop: `auto` (uvloop when installed), `uvloop`, `asyncio`"
)
ROUTER_HTTP = _router(
    "http", str, "auto", "uvicorn's HTTP parser: `auto` (httptools when installed), `httptools`, `h11`"
)
ROUTER_MAX_INFLIGHT = _router(
    "max_inflight", int, 4096, "requests in this router process at once; beyond it 429 + Retry-After"
)
ROUTER_RETRY_AFTER_S = _router("retry_after_s", int, 1, "the Retry-After of a 429")
ROUTER_DEFAULT_MAX_TOKENS = _router(
    "default_max_tokens", int, 1024, "chat without `max_tokens`: min(this, what fits the context)"
)
ROUTER_ROUTING = _router(
    "routing",
    str,
    "cache_aware",
    "`cache_aware` or `round_robin` (the baseline); router/decision/policy.py has the scores",
)
ROUTER_DISAGG_MIN_PROMPT_TOKENS = _router(
    "disagg_min_prompt_tokens", int, 256, "shorter prompts are prefilled on the decode pod (fixed placement)"
)
ROUTER_LOCAL_PREFIX_FRACTION = _router(
    "local_prefix_fraction", float, 0.8, "a decode pod holding this much of the prompt prefills it (fixed placement)"
)
ROUTER_PREFILL_LOAD_WEIGHT = _router(
    "prefill_load_weight", float, 0.5, "weight of a prefill pod's queued tokens in its score"
)
ROUTER_IMBALANCE_ABS_TOKENS = _router(
    "imbalance_abs_tokens", int, 2048, "load gap (tokens) beyond which load wins over cache hits"
)
ROUTER_IMBALANCE_RATIO = _router("imbalance_ratio", float, 1.5, "load ratio beyond which load wins over cache hits")
ROUTER_DECODE_KV_WEIGHT = _router("decode_kv_weight", float, 4.0, "weight of a decode pod's KV use in its score")
ROUTER_SAMPLE_WORKERS = _router(
    "sample_workers",
    int,
    0,
    "per request, score this many ready workers of each role picked at random plus as many of those holding the "
    "longest cached prefix, not every worker (power of k choices: a large fleet's per-request cost stays O(k)); "
    "0 = every ready worker",
)
ROUTER_RECENT_ROUTE_TTL_S = _router(
    "recent_route_ttl_s", float, 10.0, "how long the router's own placements count as cached"
)
ROUTER_PLACEMENT = _router(
    "placement",
    str,
    "fixed",
    "`fixed` (the two thresholds above) or `adaptive`: local vs. disaggregated per request from predicted TTFT and "
    "ITL against the SLO targets and the workers' measured rates (router/decision/cost_model.py)",
)
ROUTER_TRANSFER_TOKENS_PER_S = _router(
    "transfer_tokens_per_s", float, 200_000.0, "KV transfer rate assumed until workers publish one"
)
ROUTER_ADMIT_MAX_WAITING = _router(
    "admit_max_waiting",
    int,
    64,
    "a decode worker with this many waiting requests (plus those sent since its last snapshot) is full: 429; 0 = off",
)
ROUTER_ADMIT_MAX_QUEUED_PREFILL_TOKENS = _router(
    "admit_max_queued_prefill_tokens",
    int,
    32768,
    "a worker with this many prompt tokens queued for prefill is full (a floor, raised by the next); 0 = off",
)
ROUTER_ADMIT_QUEUE_SECONDS = _router(
    "admit_queue_seconds", float, 2.0, "... raised to what the worker prefills in this long (its measured rate)"
)
ROUTER_ADMIT_BY_TTFT = _router(
    "admit_by_ttft",
    int,
    1,
    "1: a request no worker is predicted to serve within its SLO class's TTFT target gets 429 + Retry-After "
    "at once, lower classes first (router/decision/admission.py, router/decision/ttft_model.py); 0 = off",
)
ROUTER_TTFT_ERROR_QUANTILE = _router(
    "ttft_error_quantile",
    float,
    0.99,
    "TTFT admission scales its predictions by this quantile of served requests' measured / predicted TTFT, the "
    "smaller of the last period's and the one's before (each 5 s and 10 requests at least, 2 s apart; between 1 "
    "and 2; router/decision/ttft_error.py); 0 = off",
)
ROUTER_POLL_INTERVAL_S = _router(
    "poll_interval_s", float, 0.25, "worker load polls; also how fresh the load admission and routing read is"
)
ROUTER_POLL_TIMEOUT_S = _router("poll_timeout_s", float, 2.0, "a slower poll makes the worker stale, not down")
ROUTER_DOWN_AFTER_FAILURES = _router(
    "down_after_failures", int, 3, "a worker is down after this many failed polls in a row ..."
)
ROUTER_DOWN_AFTER_S = _router(
    "down_after_s", float, 5.0, "... and nothing heard from it (polls, stream events) for this long"
)
ROUTER_CONNECT_TIMEOUT_S = _router("connect_timeout_s", float, 3.0, "upstream connect deadline")
ROUTER_FIRST_TOKEN_TIMEOUT_S = _router("first_token_timeout_s", float, 300.0, "upstream deadline for the first token")
ROUTER_INTER_TOKEN_TIMEOUT_S = _router("inter_token_timeout_s", float, 120.0, "upstream deadline between tokens")
ROUTER_STALL_EXIT_S = _router(
    "stall_exit_s",
    float,
    60.0,
    "a router process whose event loop is stuck this long exits (stacks written first) so a fresh one takes its "
    "place: uvicorn's supervisor starts it, or the pod restarts; 0: never",
)
ROUTER_REDIS_TIMEOUT_S = _router("redis_timeout_s", float, 0.2, "prefix-index lookups give up after this long")
ROUTER_MIGRATION_LIMIT = _router(
    "migration_limit", int, 3, "a stream whose decode worker is lost continues on another, at most this many times"
)
ROUTER_MIGRATION_WAIT_S = _router(
    "migration_wait_s", float, 30.0, "a continuation waits this long for a decode worker to be ready"
)


def _http(name: str, parse: Callable[[str], T], default: T, doc: str, **extra: Any) -> Setting[T]:
    """An HTTP limit of the router and the workers' control planes: `KVFERRY_HTTP_<NAME>` (docs/reliability.md
    "HTTP limits" says what a client sees)."""
    return declare(f"KVFERRY_HTTP_{name.upper()}", parse, default, doc, "all", "common/settings.py", **extra)


HTTP_MAX_URL_BYTES = _http("max_url_bytes", int, 8 * 1024, "the request target (path and query): 414 above")
HTTP_MAX_HEADER_BYTES = _http("max_header_bytes", int, 64 * 1024, "every header line together: 431 above")
HTTP_MAX_HEADER_COUNT = _http("max_header_count", int, 128, "header lines: 431 above")
HTTP_MAX_BODY_BYTES = _http("max_body_bytes", int, 8 * 1024 * 1024, "request body, declared or streamed: 413 above")
HTTP_MAX_INTERNAL_BODY_BYTES = _http(
    "max_internal_body_bytes",
    int,
    64 * 1024 * 1024,
    "request body on a worker's control plane (token ids from the router and peers: a long prompt as ids is "
    "about twice its text's size): 413 above",
)
HTTP_HEADER_TIMEOUT_S = _http(
    "header_timeout_s",
    float,
    15.0,
    "from a request's first byte (or the connection's opening) to the end of its headers; then 408 and a close",
)
HTTP_BODY_TIMEOUT_S = _http(
    "body_timeout_s",
    float,
    60.0,
    "from the end of the headers to the end of the body; then 408 (or a close, once a response has begun)",
)
HTTP_WRITE_TIMEOUT_S = _http(
    "write_timeout_s",
    float,
    30.0,
    "a response the client stops reading (nothing of it taken for this long while more waits to be sent) is cut: "
    "the connection closed, as if the client had hung up (a router stream's request is aborted on its workers)",
)
# Above the idle timeouts of what sits in front (httpx and the openai SDK drop idle connections after 5 s, nginx
# 60-75 s, cloud load balancers 60 s): the client should be the side that closes an idle connection. When the
# server closes it first, a request the client sends on it meanwhile is lost in transit (a read error the client
# cannot safely retry: a soak's client waiting out a 5 s Retry-After on a 5 s keep-alive lost one that way).
HTTP_KEEP_ALIVE_S = _http("keep_alive_s", float, 75.0, "an idle connection between requests is closed after this")
HTTP_MAX_CONNECTIONS = _http(
    "max_connections", int, 16384, "open connections per server process; a request beyond it gets 503; 0 = no cap"
)


def _schema_limit(name: str, default: int, doc: str) -> Setting[int]:
    """A bound on a client's output constraint, checked by the router before any work (400 naming it)."""
    return declare(f"KVFERRY_ROUTER_{name.upper()}", int, default, doc, "router", "router/surface/structured.py")


ROUTER_SCHEMA_MAX_PROPERTIES = _schema_limit(
    "schema_max_properties",
    500,
    "object properties in one JSON schema, all objects together (its grammar's compile time grows faster "
    "than their count: bench/RESULTS.md, 'Figures behind choices in the code')",
)
ROUTER_SCHEMA_MAX_ENUM_VALUES = _schema_limit(
    "schema_max_enum_values", 1000, "`enum` values and `const`s in one JSON schema, all together (OpenAI's limit)"
)
ROUTER_SCHEMA_MAX_ENUM_CHARS = _schema_limit(
    "schema_max_enum_chars",
    15000,
    "characters of the string `enum` values and `const`s of one JSON schema, and of `guided_choice` (OpenAI's limit)",
)
ROUTER_GRAMMAR_MAX_BYTES = _schema_limit(
    "grammar_max_bytes", 16384, "a `guided_regex` or `guided_grammar` (EBNF), in UTF-8 bytes"
)


# ---- debugging -------------------------------------------------------------------------------------------------
DEBUG_CHECKSUMS = declare(
    "KVFERRY_DEBUG_CHECKSUMS",
    only_one,
    False,
    "`1` = checksum KV pages on both ends of each transfer",
    "workers",
    "common/worker/engine_host.py",
    shown_default="unset",
    kind="debug",
)
LOOP_STALL_DUMP_S = declare(
    "KVFERRY_LOOP_STALL_DUMP_S",
    float,
    10.0,
    "N > 0: a router or worker HTTP process whose event loop does not run for N s writes every thread's stack to "
    "its log, once per stall; 0: off",
    "all",
    "common/loop_watchdog.py",
)
HANG_DUMP_S = declare(
    "KVFERRY_HANG_DUMP_S",
    float,
    0.0,
    "N = a tensor-parallel follower prints every thread's stack and exits after N s",
    "workers",
    "common/engine/tp_follower.py",
    shown_default="unset",
    kind="debug",
)

# ---- set by kvferry for its own processes ----------------------------------------------------------------------
TP_PARENT = declare(
    "KVFERRY_TP_PARENT",
    int,
    0,
    "rank 0's pid, set for its followers (they exit when it is gone)",
    "workers",
    "common/engine/tp_follower.py",
    shown_default="set by rank 0",
    kind="internal",
)
ROUTER_CHILD_SETTINGS = declare(
    "KVFERRY_ROUTER_CHILD_SETTINGS",
    str,
    "",
    "the settings the first router process resolved (env and flags), handed to the others",
    "router",
    "router/main.py",
    shown_default="set by `kvferry router`",
    kind="internal",
)

# ---- test hooks: fault injection, never set in a deployment (the manifests' test rejects them) -----------------
FAULT_WRITE_DELAY_S = declare(
    "KVFERRY_FAULT_WRITE_DELAY_S",
    float,
    0.0,
    "N = every KV write of a prefill worker lands N s late and cannot be called back meanwhile (the transfer "
    "race tests)",
    "prefill workers",
    "prefill_worker/engine.py",
    shown_default="unset",
    kind="test",
)
FAULT_ENGINE_CALL_TIMEOUT_S = declare(
    "KVFERRY_FAULT_ENGINE_CALL_TIMEOUT_S",
    float,
    0.0,
    "N = a worker's control plane waits only N s (instead of 30) for its engine's answer to a call, so a busy "
    "engine answers too late (504 `engine_timeout`: the overload tests)",
    "workers",
    "common/worker/channel.py",
    shown_default="unset",
    kind="test",
)


# ---- the docs --------------------------------------------------------------------------------------------------
DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
TABLE_BEGIN = "<!-- settings table: generated by `python -m common.settings_registry --write-docs` -->"
TABLE_END = "<!-- end of the settings table -->"
_HEADINGS = {
    "setting": "",
    "debug": "Debugging switches:",
    "internal": "Set by kvferry for its own processes:",
    "test": "Test hooks (fault injection; the manifests may not set them):",
}


def render_table(settings: Iterable[Setting[Any]] | None = None) -> str:
    """The docs' tables of the settings, one per kind, between the markers docs/architecture.md carries."""
    settings = list(REGISTRY.values() if settings is None else settings)
    out = [TABLE_BEGIN]
    for kind in KINDS:
        rows = [s for s in settings if s.kind == kind]
        if not rows:
            continue
        if _HEADINGS[kind]:
            out += ["", _HEADINGS[kind]]
        out += ["", "| var | default | what | read by |", "| --- | --- | --- | --- |"]
        out += [f"| {_var_cell(s)} | {s.default_cell()} | {s.doc} | {_read_by_cell(s)} |" for s in rows]
    return "\n".join([*out, TABLE_END])


def _var_cell(s: Setting[Any]) -> str:
    return f"`{s.name}`" + (f" (`{s.flag_name}`)" if s.flag else "")


def _read_by_cell(s: Setting[Any]) -> str:
    return f"{s.who} ({', '.join(f'`{m}`' for m in s.read_in.split(', '))})"


def docs_with_table(text: str) -> str:
    pattern = re.compile(re.escape(TABLE_BEGIN) + ".*?" + re.escape(TABLE_END), re.S)
    assert pattern.search(text), f"{DOCS} has no settings table markers"
    return pattern.sub(lambda _m: render_table(), text, count=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m common.settings_registry", description="Print or write the settings table."
    )
    p.add_argument("--write-docs", action="store_true", help=f"rewrite the table in {DOCS.name}")
    args = p.parse_args(argv)
    if args.write_docs:
        DOCS.write_text(docs_with_table(DOCS.read_text()))
    else:
        print(render_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
