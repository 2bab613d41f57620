"""The served model's tokenizer at the router: prompts and chat templates to ids, ids to text and bytes (workers
only see ids). Hot paths call the Rust ``tokenizers`` backend directly: transformers' wrapper adds microseconds
per call, once per token per stream.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from router.surface.tools import Tool, render_for_template

log = logging.getLogger("kvferry.router")

__all__ = ["ModelInfo", "PromptTooLong", "RouterTokenizer", "load_tokenizer"]

# Texts longer than this are counted in pieces first, so a prompt far past the context costs about a context's work.
_PIECE_CHARS = 16384
# Tokens a cut between two pieces may add to their sum (a word split in two): allowed past the limit per cut.
_CUT_SLACK = 4


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id clients pass as "model" (and the prefix index's model id)
    path: Path | None
    max_context: int  # max_position_embeddings: prompt + completion must fit
    created: int = 0
    aliases: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_dir(cls, name: str, path: Path) -> ModelInfo:
        with open(path / "config.json") as f:
            cfg = json.load(f)
        ctx = int(cfg.get("max_position_embeddings") or cfg.get("max_sequence_length") or 4096)
        created = int(path.stat().st_mtime) if path.exists() else 0
        return cls(name=name, path=path, max_context=ctx, created=created, aliases=(path.name, str(path)))

    def serves(self, model: str | None) -> bool:
        return model is None or model == self.name or model in self.aliases


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each raw byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _utf8_size(text: str) -> int:
    """The text's size in UTF-8 bytes; lone surrogates (valid in JSON, not Unicode) are refused clearly."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise ValueError(
            f"the input contains a lone surrogate (\\u{ord(bad):04x}) at character {exc.start}: not valid Unicode"
        ) from None


def _cut(text: str, end: int) -> int:
    """Where a piece ending near ``end`` ends: before the last space or line break in its last quarter, else ``end``."""
    if end >= len(text):
        return len(text)
    low = end - _PIECE_CHARS // 4
    at = max(text.rfind(" ", low, end), text.rfind("\n", low, end))
    return at if at > low else end


class PromptTooLong(Exception):
    """A text with more tokens than ``limit``, found before tokenizing all of it (``at_least``: what is proven)."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"at least {at_least} tokens, more than {limit}")
        self.at_least = at_least
        self.limit = limit


class RouterTokenizer:
    """The model's Rust tokenizer plus its chat template, without transformers (which imports torch)."""

    def __init__(self, backend: Any, chat_template: str | None, special_tokens: dict[str, str]) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.special_tokens = special_tokens  # bos_token, eos_token, ...: the template may print them
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(int(i) for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._byte_level = "ByteLevel" in repr(getattr(backend, "decoder", ""))
        self._bytes_cache: dict[int, bytes] = {}
        # The longest token in bytes: a text of B bytes has at least B / this many tokens.
        self.max_token_bytes = max(1, max(len(self.token_bytes(i)) for i in range(self.vocab_size)))

    @classmethod
    def from_dir(cls, path: Path) -> RouterTokenizer:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            config = json.loads((path / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(backend, template, special)

    @property
    def needs_context(self) -> bool:
        """Whether the first output token needs prompt ids before it (SentencePiece drops a leading space)."""
        return not self._byte_level

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """The text's token ids; with ``limit``, PromptTooLong after about ``limit`` tokens at most (cost bounded
        by the limit, the count still exact)."""
        size = _utf8_size(text)
        if limit is not None:
            self._check_size(text, size, limit)
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def _check_size(self, text: str, size: int, limit: int) -> None:
        at_least = -(-size // self.max_token_bytes)
        if at_least > limit:
            raise PromptTooLong(at_least, limit)
        if len(text) <= _PIECE_CHARS:
            return
        counted = cuts = start = 0
        while start < len(text):
            end = _cut(text, start + _PIECE_CHARS)
            counted += len(self._backend.encode(text[start:end], add_special_tokens=False))
            if counted > limit + cuts * _CUT_SLACK:
                raise PromptTooLong(limit + 1, limit)
            start, cuts = end, cuts + 1

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[Tool] | None = None,
        limit: int | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The chat template applied (an assistant turn opened, or the last message left open to continue) and
        tokenized (``limit`` as in ``encode``); ValueError when the template rejects the conversation."""
        if not self.chat_template:
            raise ValueError("this model has no chat template: use /v1/completions")
        from transformers.utils.chat_template_utils import render_jinja_template

        messages, template_tools = render_for_template(messages, tools, self.chat_template)
        try:
            rendered = render_jinja_template(
                [messages],
                tools=template_tools,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **self.special_tokens,
            )
        except Exception as exc:  # jinja's TemplateError and friends: the client's conversation is at fault
            raise ValueError(f"the chat template rejected the messages: {exc}") from exc
        text = rendered[0] if isinstance(rendered, tuple) else rendered
        if isinstance(text, list):
            text = text[0]
        # The template writes the special tokens itself.
        return self.encode(text, add_special_tokens=False, limit=limit)

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI's logprobs ``bytes``)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._backend.id_to_token(int(token_id))
        if piece is None:
            out = b""
        elif token_id in self.special_ids:
            out = piece.encode()
        elif self._byte_level:
            table = _byte_decoder()
            try:
                out = bytes(table[c] for c in piece)
            except KeyError:  # an added token outside the byte alphabet
                out = piece.encode()
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out = bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        else:
            out = piece.replace("\u2581", " ").encode()
        if len(self._bytes_cache) < 1_000_000:
            self._bytes_cache[token_id] = out
        return out

    def token_str(self, token_id: int) -> str:
        """One token as text; part of a UTF-8 character shows as escaped bytes, as OpenAI does."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def load_tokenizer(model: str, tokenizer_dir: str = "") -> tuple[RouterTokenizer, ModelInfo]:
    """Loads the tokenizer and model info for ``model``; ``tokenizer_dir`` serves a model id that is not a
    directory (``dummy:<config>`` workers); the id stays what clients pass."""
    from common.default_model import resolve_model_path

    path = Path(tokenizer_dir).expanduser() if tokenizer_dir else resolve_model_path(model)
    return RouterTokenizer.from_dir(path), ModelInfo.from_dir(model, path)
