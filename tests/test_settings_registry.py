"""The settings registry (common/settings_registry.py) is the one place a `KVFERRY_*` setting is declared: the
docs table is what it renders, production code reads no variable past it, each declaration says truly where it
is read, and the commands' flags and configs come from it."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from common import settings_registry as reg
from common.config import RouterConfig, WorkerConfig, worker_arg_parser
from common.prefix.access import RedisAccess
from common.settings import HttpLimits, RunnerConfig, SchedulerConfig
from router.main import build_parser, parse_config
from router.settings import RouterOptions

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = ("common", "router", "prefill_worker", "decode_worker", "mixed_worker")
CONFIGS = (WorkerConfig, RunnerConfig, SchedulerConfig, RouterConfig, RouterOptions, HttpLimits, RedisAccess)
CONSTANT = {s.name: const for const, s in vars(reg).items() if isinstance(s, reg.Setting)}


def production_files() -> list[Path]:
    return [p for pkg in PRODUCTION for p in sorted((ROOT / pkg).rglob("*.py"))]


def kvferry_literal(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("KVFERRY_"):
        return node.value
    return None


def test_docs_table_is_what_the_registry_renders() -> None:
    text = reg.DOCS.read_text()
    assert reg.docs_with_table(text) == text, "stale: run `python -m common.settings_registry --write-docs`"


def test_production_code_reads_kvferry_variables_only_through_the_registry() -> None:
    """No `os.environ.get("KVFERRY_...")`, `environ["KVFERRY_..."]` or `getenv` past the registry, and every
    `KVFERRY_*` name the code writes (for child processes) is a declared one."""
    stray, unknown = [], []
    for path in production_files():
        if path == ROOT / "common" / "settings_registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                if node.func.attr in ("get", "getenv") and kvferry_literal(node.args[0]):
                    stray.append(where)
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and kvferry_literal(node.slice):
                stray.append(where)
            name = kvferry_literal(node)
            if name and name.upper() == name and " " not in name and name not in reg.REGISTRY:
                unknown.append(f"{where} {name}")
    assert stray == [], f"read these through common/settings_registry.py: {stray}"
    assert unknown == [], f"declare these in common/settings_registry.py: {unknown}"


def test_each_declaration_names_the_modules_that_read_it() -> None:
    for name, setting in reg.REGISTRY.items():
        for module in setting.read_in.split(", "):
            used = re.search(rf"\b{CONSTANT[name]}\b", (ROOT / module).read_text())
            assert used, f"{name}: {module} does not use {CONSTANT[name]}"


def test_bound_fields_take_the_declared_defaults() -> None:
    bound = set()
    for cls in CONFIGS:
        made = cls(role="decode") if cls is WorkerConfig else cls()
        for f in dataclasses.fields(cls):
            setting = reg.binding(f)
            if setting is None:
                continue
            bound.add(setting.name)
            if (cls, f.name) != (RouterConfig, "port"):  # the one reader with a default of its own: 8000
                assert getattr(made, f.name) == setting.default, (cls.__name__, f.name)
    config_modules = {"common/config.py", "common/settings.py", "router/settings.py", "common/prefix/access.py"}
    unbound = [
        s.name for s in reg.REGISTRY.values() if set(s.read_in.split(", ")) & config_modules and s.name not in bound
    ]
    assert unbound == [], f"declared as read by a config, bound by none of its fields: {unbound}"


def test_router_options_are_kvferry_router_and_their_field_name() -> None:
    for f in dataclasses.fields(RouterOptions):
        setting = reg.binding(f)
        assert setting is not None and setting.name == f"KVFERRY_ROUTER_{f.name.upper()}", f.name


def test_flags_are_the_bound_field_names() -> None:
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            setting = reg.binding(f)
            if setting is not None and setting.flag:
                assert setting.flag_name == "--" + f.name.replace("_", "-"), (cls.__name__, f.name)


def test_help_of_every_command_renders() -> None:
    for role in ("prefill", "decode", "mixed"):
        assert "--max-seq-len" in worker_arg_parser(role).format_help()
    router_help = build_parser().format_help()
    assert "--max-inflight" in router_help and "KVFERRY_ROUTER_MAX_INFLIGHT" in router_help


def test_settings_that_had_no_way_in_are_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_ATTENTION", "torch")
    monkeypatch.setenv("KVFERRY_CUDA_GRAPH_MAX_BS", "0")
    monkeypatch.setenv("KVFERRY_MAX_SEQ_LEN", "512")
    runner = WorkerConfig.from_env("decode").runner
    assert (runner.attention, runner.cuda_graph_max_bs, runner.max_seq_len) == ("torch", 0, 512)
    args = worker_arg_parser("decode").parse_args(["--max-seq-len", "256"])
    assert WorkerConfig.from_env("decode").apply_args(args).runner.max_seq_len == 256


def test_env_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_PORT", "9100")
    monkeypatch.setenv("KVFERRY_MAX_RUNNING", "0")  # 0: by device
    monkeypatch.setenv("KVFERRY_HOST_KV_GB", "auto")
    monkeypatch.setenv("KVFERRY_POD_NAME", "")  # empty: unset
    cfg = WorkerConfig.from_env("prefill")
    assert (cfg.port, cfg.runner.max_running, cfg.sched.host_kv_gb) == (9100, 64, -1.0)
    assert cfg.pod_name.endswith("-prefill-9100")
    monkeypatch.setenv("KVFERRY_DECODE_URLS", "http://a:1/, http://b:2")
    monkeypatch.setenv("KVFERRY_ROUTER_TRANSFER_TOKENS_PER_S", "50000")
    config, options, _ = parse_config(["--port", "8001", "--max-inflight", "7"])
    assert (config.port, config.decode_urls, config.api_key) == (8001, ["http://a:1", "http://b:2"], None)
    assert (options.transfer_tokens_per_s, options.max_inflight) == (50000.0, 7)


def test_a_bad_value_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_PAGE_SIZE", "sixteen")
    with pytest.raises(ValueError, match="KVFERRY_PAGE_SIZE='sixteen'"):
        WorkerConfig.from_env("decode")


def test_several_router_processes_get_the_settings_their_parent_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    """With KVFERRY_ROUTER_WORKERS > 1 each router process builds its config from the JSON its parent hands down:
    the nested settings (Redis credentials and key prefix, the internal token) come back as what they were."""
    monkeypatch.setenv("KVFERRY_REDIS_PASSWORD", "s3cret")
    monkeypatch.setenv("KVFERRY_REDIS_PREFIX", "team-a")
    monkeypatch.setenv("KVFERRY_INTERNAL_TOKEN", "tok-1,tok-2")
    config, options, _ = parse_config(["--port", "9123"])
    handed = json.loads(json.dumps({"config": dataclasses.asdict(config), "options": dataclasses.asdict(options)}))
    again = reg.rebuilt(RouterConfig, handed["config"])
    assert again == config and again.port == 9123
    assert (
        again.redis_access.key_prefix == "team-a"
        and again.redis_access.client_kwargs("redis://r")["password"] == "s3cret"
    )
    assert again.internal_token.tokens == ("tok-1", "tok-2")
    assert reg.rebuilt(RouterOptions, handed["options"]) == options
