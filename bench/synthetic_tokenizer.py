"""A word-level tokenizer whose vocabulary covers any model's ids: id i <-> the word "t<i>".

Benchmarks serve random-weight models (``dummy:<config>``), which ship no tokenizer, and send prompts as
token ids. The router still needs a tokenizer to detokenize what it streams; this one decodes every id to
one word, so a client counts the tokens in each streamed event exactly (one word each), whatever the
model. It has no special tokens, so no generated id is ever skipped in the text.

    python bench/synthetic_tokenizer.py --vocab 128256 --max-context 131072 --out /tmp/tok

writes a directory that transformers' ``AutoTokenizer`` loads (tokenizer.json, tokenizer_config.json)
plus the config.json the router reads the context length from; pass it to the router as
``KVFERRY_ROUTER_TOKENIZER`` (or ``kvferry router --tokenizer DIR``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["build_word_tokenizer", "count_words", "word"]

_WORD_PREFIX = "t"


def word(token_id: int) -> str:
    return f"{_WORD_PREFIX}{token_id}"


def count_words(text: str) -> int:
    """Tokens in a piece of streamed text detokenized by this tokenizer."""
    return len(text.split())


def build_word_tokenizer(out_dir: str | Path, vocab_size: int, max_context: int) -> Path:
    """Writes the tokenizer directory (idempotent: an existing one of the same size is kept)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(out_dir)
    config = {"vocab_size": vocab_size, "max_position_embeddings": max_context}
    config_path = out / "config.json"
    if (out / "tokenizer.json").exists() and config_path.exists():
        if json.loads(config_path.read_text()) == config:
            return out
    out.mkdir(parents=True, exist_ok=True)
    # The unknown word is deliberately outside the vocabulary: an in-vocabulary unk would be a special
    # token, and decoding skips special tokens, so that id would vanish from the stream.
    tok = Tokenizer(models.WordLevel({word(i): i for i in range(vocab_size)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_context}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    config_path.write_text(json.dumps(config, indent=1))  # written last: marks the directory complete
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, required=True, help="the model's vocabulary size")
    p.add_argument("--max-context", type=int, default=131072, help="context length the router enforces")
    p.add_argument("--out", required=True, help="directory to write")
    args = p.parse_args()
    print(build_word_tokenizer(args.out, args.vocab, args.max_context))


if __name__ == "__main__":
    main()
