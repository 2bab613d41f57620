"""The served model's tokenizer at the router: prompts and chat templates to ids, ids to text and bytes.

Tokenizing at the router lets it hash the prompt's blocks for prefix routing and check the context
length before any worker is involved; workers only ever see token ids. The hot paths (``decode`` per
streamed token, ``encode``) call the Rust ``tokenizers`` backend directly: transformers' Python wrapper
adds several microseconds per call, which matters once per token per stream.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger("kvferry.router")

__all__ = ["ModelInfo", "RouterTokenizer", "load_tokenizer"]


@dataclass(frozen=True)
class ModelInfo:
    """What the router needs to know about the served model besides its tokenizer."""

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


class RouterTokenizer:
    """Wraps a transformers tokenizer (anything with ``backend_tokenizer`` is fast-pathed)."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self._backend = getattr(hf, "backend_tokenizer", None)
        self.vocab_size = len(hf)
        self.special_ids = frozenset(int(i) for i in getattr(hf, "all_special_ids", ()) or ())
        decoder = repr(getattr(self._backend, "decoder", "")) if self._backend is not None else ""
        self._byte_level = "ByteLevel" in decoder
        self._bytes_cache: dict[int, bytes] = {}

    @property
    def needs_context(self) -> bool:
        """Whether decoding the first output token needs prompt ids before it: SentencePiece-style
        tokenizers drop a sequence's leading space; byte-level BPE decodes each token the same anywhere."""
        return not self._byte_level

    # ---- text -> ids -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=True).ids)
        return list(self.hf.encode(text))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Applies the model's chat template (with the assistant turn opened) and tokenizes the result.
        Raises ValueError when the template rejects the conversation (e.g. roles out of order)."""
        try:
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # jinja's TemplateError and friends: the client's conversation is at fault
            raise ValueError(f"the chat template rejected the messages: {exc}") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    # ---- ids -> text -------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=True)
        return self.hf.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (what OpenAI's chat logprobs report as ``bytes``)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        piece = self.hf.convert_ids_to_tokens(int(token_id))
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
        """One token as text; a token that is only part of a UTF-8 character is shown as escaped bytes,
        the way OpenAI shows it (``bytes:\\xe4\\xb8``)."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def load_tokenizer(model: str, tokenizer_dir: str = "") -> tuple[RouterTokenizer, ModelInfo]:
    """Loads the tokenizer and model info for ``model`` (the embedded default's name or a local dir).

    ``tokenizer_dir`` (a directory with the tokenizer files and config.json) serves a model whose id is
    not a directory: workers running ``dummy:<config>`` weights for benchmarks, say. The model id stays
    what clients pass and what workers publish to the prefix index under."""
    from transformers import AutoTokenizer

    from common.default_model import resolve_model_path

    path = Path(tokenizer_dir).expanduser() if tokenizer_dir else resolve_model_path(model)
    hf = AutoTokenizer.from_pretrained(path)
    return RouterTokenizer(hf), ModelInfo.from_dir(model, path)
