"""Grammar-constrained decoding: compiled grammars and one matcher per request, on the worker that samples.

A request carries its grammar as a spec, never as compiled state: the decode worker compiles the same spec and
replays the tokens already sampled (microseconds), where shipping matcher state would tie both workers to one
xgrammar build. How masks keep the overlap: docs/architecture.md, "The scheduler loop".
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.protocol import GrammarSpec
from common.sched.request import Req

log = logging.getLogger("kvferry.sched")

_SOURCE_PREFIX = re.compile(r"^(\[[^\]]*\]\s*)?\S+\.(cc|h|cpp):\d+:\s*")
_CACHE_ENTRIES = 256  # compiled grammars kept per worker (xgrammar's compiler has its own cache too)


MAX_FILL_THREADS = 4
CORES_PER_FILL_THREAD = 4


def default_fill_threads() -> int:
    """xgrammar's threads for one batch fill: a quarter of the usable cores, 1 to 4 (more gained nothing)."""
    from common.engine.threads import usable_cores

    return max(1, min(MAX_FILL_THREADS, usable_cores() // CORES_PER_FILL_THREAD))


_NO_TOKENIZER = "structured output needs the model's tokenizer; this worker has none (dummy weights)"


class GrammarError(ValueError):
    """A grammar this worker cannot compile (an invalid or unsupported schema, regex or EBNF)."""


@dataclass(eq=False)
class _Matching:
    matcher: Any  # xgrammar.GrammarMatcher
    req_id: str
    consumed: int = 0  # output tokens the matcher has accepted
    broken: bool = False  # a token the grammar does not allow was appended


@dataclass(eq=False)
class _Compiler:
    """One tokenizer's xgrammar compiler and the grammars it compiled, shared by every scheduler of the process
    (an engine rebuilt after a fault starts warm): the tokenizer's tables take seconds to build."""

    xgr: Any  # xgrammar.GrammarCompiler
    mask_vocab: int  # the token ids a mask covers: the tokenizer's, not an LM head padded past them
    mask_stops: list[int]  # the stop ids inside the masks
    compiled: OrderedDict[tuple[str, str], Any] = field(default_factory=OrderedDict)
    # Compile threads and fill threads share it: the LRU's reorder and eviction must not interleave.
    lock: threading.Lock = field(default_factory=threading.Lock)


_compilers: dict[tuple[str, int, tuple[int, ...]], _Compiler] = {}
_compilers_lock = threading.Lock()


def _compiler_key(model_path: Path | None, vocab: int, stop_ids: Sequence[int]) -> tuple[str, int, tuple[int, ...]]:
    return (str(model_path), vocab, tuple(stop_ids))


def _shared_compiler(model_path: Path, vocab: int, stop_ids: Sequence[int]) -> _Compiler:
    key = _compiler_key(model_path, vocab, stop_ids)
    with _compilers_lock:  # a second scheduler starting meanwhile waits for this one's tables
        shared = _compilers.get(key)
        if shared is None:
            shared = _compilers[key] = _build_compiler(model_path, vocab, stop_ids)
        return shared


def _build_compiler(model_path: Path, vocab: int, stop_ids: Sequence[int]) -> _Compiler:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    ids = tok.get_vocab().values()
    # xgrammar would fill each id of an LM head padded past the tokenizer as a token of its own; the sampler
    # bans those ids on grammar rows.
    mask_vocab = min(vocab, max(len(ids), max(ids) + 1))
    mask_stops = [t for t in stop_ids if t < mask_vocab]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=mask_vocab, stop_token_ids=mask_stops or None)
    threads = max(1, min(8, os.cpu_count() or 1))
    return _Compiler(xgr.GrammarCompiler(info, max_threads=threads), mask_vocab, mask_stops)


class GrammarBook:
    """The grammars of one scheduler's requests; xgrammar is imported on first use only."""

    def __init__(
        self, model_path: Path | None, vocab: int, stop_ids: Sequence[int], fill_threads: int | None = None
    ) -> None:
        self.model_path = model_path
        self.fill_threads = fill_threads if fill_threads is not None else default_fill_threads()
        self.vocab = vocab
        self.stop_ids = sorted(stop_ids)
        self._shared: _Compiler | None = None
        self._batch: Any = None
        self._init_lock = threading.Lock()
        self._matching: weakref.WeakKeyDictionary[Req, _Matching] = weakref.WeakKeyDictionary()
        self._last_rows: _BatchRows | None = None
        self._stop_words: tuple[torch.Tensor, torch.Tensor] | None = None  # word index and bits of the stop ids

    def cached(self, spec: GrammarSpec) -> bool:
        shared = self._shared or _compilers.get(_compiler_key(self.model_path, self.vocab, self.stop_ids))
        if shared is None:
            return False
        with shared.lock:
            return (spec.kind, spec.value) in shared.compiled

    def _compiler(self) -> _Compiler:
        if self._shared is not None:
            return self._shared
        with self._init_lock:  # the compile thread and the scheduler's may both be first
            if self._shared is None:
                if self.model_path is None:
                    raise GrammarError(_NO_TOKENIZER)
                import xgrammar as xgr

                self._shared = _shared_compiler(self.model_path, self.vocab, self.stop_ids)
                self._batch = xgr.BatchGrammarMatcher(max_threads=self.fill_threads)
            return self._shared

    @property
    def mask_vocab(self) -> int:
        """The token ids a mask covers (the tokenizer's, at most the model's vocabulary)."""
        return self._compiler().mask_vocab

    @property
    def mask_words(self) -> int:
        return (self.mask_vocab + 31) // 32

    def check(self, spec: GrammarSpec) -> None:
        """GrammarError when `spec` does not parse (milliseconds, against seconds to compile): a bad grammar is
        refused on arrival and only the compile runs off the loop."""
        if self.model_path is None:
            raise GrammarError(_NO_TOKENIZER)
        import xgrammar as xgr

        try:
            if spec.kind == "json_schema":
                json.loads(spec.value)
                xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
            elif spec.kind == "regex":
                xgr.Grammar.from_regex(spec.value)
            elif spec.kind == "ebnf":
                xgr.Grammar.from_ebnf(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {_first_line(exc)}") from None

    def compile(self, spec: GrammarSpec) -> Any:
        shared = self._compiler()
        key = (spec.kind, spec.value)
        with shared.lock:
            hit = shared.compiled.get(key)
            if hit is not None:
                shared.compiled.move_to_end(key)
                return hit
        compiler = shared.xgr
        try:
            if spec.kind == "json_schema":
                json.loads(spec.value)  # a clearer message than the converter's for text that is not JSON
                compiled = compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
            elif spec.kind == "json_object":  # any object (xgrammar's builtin JSON grammar allows any value)
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value)
            else:
                compiled = compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {_first_line(exc)}") from None
        with shared.lock:
            shared.compiled[key] = compiled
            if len(shared.compiled) > _CACHE_ENTRIES:
                shared.compiled.popitem(last=False)
        return compiled

    def _state(self, req: Req) -> _Matching:
        st = self._matching.get(req)
        if st is None:
            import xgrammar as xgr

            assert req.sampling.grammar is not None
            st = _Matching(xgr.GrammarMatcher(self.compile(req.sampling.grammar)), req.req_id)
            self._matching[req] = st
        return st

    def advance(self, req: Req) -> bool:
        """Feeds the request's new output tokens to its matcher; False once one was not allowed (a continued
        request's earlier output sits at its prompt's end)."""
        st = self._state(req)
        offset = req.sampling.output_offset
        earlier = req.prompt_ids[req.prompt_len - offset :] if offset else []
        total = len(earlier) + len(req.output_ids)
        while st.consumed < total and not st.broken:
            i = st.consumed
            token = earlier[i] if i < len(earlier) else req.output_ids[i - len(earlier)]
            if not st.matcher.accept_token(token):
                st.broken = True
                log.warning("token outside the grammar", extra={"req_id": req.req_id})
            st.consumed += 1
        return not st.broken

    def terminated(self, req: Req) -> bool:
        return self._state(req).matcher.is_terminated()

    def dead_end(self, req: Req) -> bool:
        """Whether the request's grammar, where its matcher stopped, allows no token of the vocabulary at all (a
        character no token spells, e.g. an unassigned code point whose bytes the tokenizer never learnt): nothing
        the sampler could have picked, so the request, not the engine, is at fault."""
        import xgrammar as xgr

        bits = xgr.allocate_token_bitmask(1, self.mask_vocab)
        self._state(req).matcher.fill_next_token_bitmask(bits)
        return not bool(bits.any())

    def _grammar_rows(self, reqs: Sequence[Req]) -> _BatchRows:
        """The grammar rows of `reqs` and their handles; the last call's again while the batch is unchanged."""
        key = tuple(reqs)
        last = self._last_rows
        if last is None or last.key != key:
            rows = [i for i, r in enumerate(reqs) if r.sampling.grammar is not None]
            states = [self._state(reqs[i]) for i in rows]
            last = self._last_rows = _BatchRows(key, rows, states, [st.matcher._handle for st in states])
        return last

    def fill(self, reqs: Sequence[Req], bits: torch.Tensor | None = None) -> GrammarMasks:
        """The bitmask of the tokens each grammar request may sample next, written into `bits` (a view of the
        step's pinned staging buffer; None: a new tensor). Rows not filled (finishing, or broken) allow all.

        The matchers first accept the step's unseen tokens in one batched call; requests whose token broke the
        grammar come back in `broken`. This runs on the fill thread, sharing the GIL with the scheduler's:
        the steady case is kept to a few list comprehensions and three calls into xgrammar and torch."""
        if bits is None:
            bits = torch.empty((len(reqs), self.mask_words), dtype=torch.int32)
        batch = self._grammar_rows(reqs)
        live = [not reqs[i].finished for i in batch.rows]
        # A row's one new token (a decode row's: never a stop token, so not terminated after it).
        fresh = [
            ok
            and bool(reqs[i].output_ids)
            and not st.broken
            and st.consumed == reqs[i].sampling.output_offset + len(reqs[i].output_ids) - 1
            for ok, i, st in zip(live, batch.rows, batch.states)
        ]
        if all(fresh):  # steady decoding
            rows, states, handles = batch.rows, batch.states, batch.handles
        else:
            picked = [k for k, ok in enumerate(live) if ok]
            rows = [batch.rows[k] for k in picked]
            states = [batch.states[k] for k in picked]
            for k in picked:
                if not fresh[k]:
                    self.advance(reqs[batch.rows[k]])  # up to date already, or a replay
            handles = [batch.handles[k] for k in picked if fresh[k]]
            fresh = [fresh[k] for k in picked]
        broken: list[Req] = []
        if handles:
            at = rows if len(handles) == len(rows) else [i for i, f in zip(rows, fresh) if f]
            ok = _batch_accept(handles, [reqs[i].output_ids[-1] for i in at])
            accepting = states if len(handles) == len(states) else [st for st, f in zip(states, fresh) if f]
            for st in accepting:
                st.consumed += 1
            if ok is not None:
                for i, st, good in zip(at, accepting, ok):
                    if not good:
                        st.broken = True
                        broken.append(reqs[i])
                        log.warning("token outside the grammar", extra={"req_id": st.req_id})
        filled = [
            (i, st.matcher._handle)
            for i, st, f in zip(rows, states, fresh)
            if not st.broken and (f or not st.matcher.is_terminated())
        ]
        if len(filled) < len(rows):
            left = {i for i, _ in filled}
            for i in rows:
                if i not in left:
                    bits[i].fill_(-1)  # it finishes when this step is processed (or now: `broken`); its row stays free
        done = [False] * len(reqs)
        if filled:
            stops = self._compiler().mask_stops
            indices = [i for i, _ in filled]
            _batch_fill(self._batch, [h for _, h in filled], bits, indices)
            for i in self._stop_allowed(bits, indices):  # rare: is anything but a stop token allowed?
                row = bits[i].clone()
                for t in stops:
                    cleared = 0xFFFFFFFF ^ (1 << (t % 32))  # as an int32: the sign bit is bit 31
                    row[t // 32] &= cleared - (1 << 32) if cleared >= 1 << 31 else cleared
                done[i] = not bool(row.any())
        return GrammarMasks(bits, rows, done, broken)

    def _stop_allowed(self, bits: torch.Tensor, rows: list[int]) -> list[int]:
        """Those of `rows` whose mask allows a stop token (the grammar may end there), read off the masks."""
        if self._stop_words is None:
            stops = self._compiler().mask_stops
            words = sorted({t // 32 for t in stops})
            masks = [sum(1 << (t % 32) for t in stops if t // 32 == w) for w in words]
            signed = [m - (1 << 32) if m >= 1 << 31 else m for m in masks]
            self._stop_words = (torch.tensor(words), torch.tensor(signed, dtype=torch.int32))
        words, masks = self._stop_words
        if not rows or not len(words):
            return []
        at = torch.tensor(rows)
        hit = (bits.index_select(1, words).index_select(0, at) & masks).ne(0).any(1)
        return at[hit].tolist()


@dataclass(eq=False)
class _BatchRows:
    key: tuple[Req, ...]
    rows: list[int]  # positions of the grammar requests in the batch
    states: list[_Matching]
    handles: list[Any]  # their matchers' xgrammar handles


@dataclass
class GrammarMasks:
    bits: torch.Tensor  # [B, mask_words] int32 on the host
    rows: list[int]  # the rows under a grammar
    done: list[bool]  # per row: the grammar allows nothing but its end
    broken: list[Req]  # requests whose last token the grammar did not allow (they finish with an error)


def _batch_accept(handles: list[Any], tokens: list[int]) -> list[bool] | None:
    """Each matcher accepts its token in one GIL-free call; None: all allowed (xgrammar's wrapper would convert
    the result row by row, holding the GIL)."""
    from xgrammar.base import _core

    result = _core.BatchGrammarMatcher.batch_accept_token(handles, tokens, False)
    rejected = 0 in result or False in result  # its elements are 0 or 1 (ints) in this build
    return [bool(v) for v in result] if rejected else None


def _batch_fill(batch: Any, handles: list[Any], bits: torch.Tensor, indices: list[int]) -> None:
    """xgrammar's batched fill on handles the caller keeps (its wrapper rebuilds the list per call)."""
    batch._handle.batch_fill_next_token_bitmask(handles, bits, indices, False)


def _first_line(exc: BaseException) -> str:
    """xgrammar's messages start with a time and a C++ source location: keep what follows."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return _SOURCE_PREFIX.sub("", text) or type(exc).__name__
