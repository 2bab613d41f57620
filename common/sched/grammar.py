"""Grammar-constrained decoding: compiled grammars and one matcher per request, on the worker that samples.

A request carries its grammar as a spec (common/protocol.py `GrammarSpec`), never as compiled state: the
prefill worker compiles it, masks the first token and hands that token on; the decode worker compiles the
same spec (a cache hit after the first request with that schema), and its matcher replays the tokens already
sampled before it masks the next one. Replaying a few tokens costs microseconds; shipping matcher state
would tie both workers to one xgrammar build.

A matcher must have accepted a request's previous token before it can mask the next one, and with overlap on
that token is still on the device when the next step is launched. So the next step's forward is launched
first; sampling waits only where a grammar row needs the step in flight: the scheduler processes that step
while the forward runs, and one job on the fill thread has the matchers accept that step's tokens (one
batched call, `BatchGrammarMatcher.batch_accept_token`) and then fills the batch's masks (one batched call)
straight into the step's pinned staging buffer; the scheduler's thread copies them to the device with the
rest of the sampling's inputs in one non-blocking copy (common/sched/step_sampling.py) and then launches the
sampling, which applies them in place (common/sched/scheduler.py `_begin_sampling`). A batch with no grammar
row samples right behind its forward, as before. The scheduler's thread feeds a matcher itself only the
tokens that may end a request (a stop token, the last token, a prompt's first), so it learns at once whether
the request ends there (`Scheduler._append_token`); a decode token the grammar rejects, found by the fill,
ends its request before any later token is appended (`GrammarMasks.broken`).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.protocol import GrammarSpec
from common.sched.request import Req

log = logging.getLogger("kvferry.sched")

_SOURCE_PREFIX = re.compile(r"^(\[[^\]]*\]\s*)?\S+\.(cc|h|cpp):\d+:\s*")
_CACHE_ENTRIES = 256  # compiled grammars kept per worker (xgrammar's compiler has its own cache too)


class GrammarError(ValueError):
    """A grammar this worker cannot compile (an invalid or unsupported schema, regex or EBNF)."""


@dataclass(eq=False)
class _Matching:
    matcher: Any  # xgrammar.GrammarMatcher
    req_id: str
    consumed: int = 0  # output tokens the matcher has accepted
    broken: bool = False  # a token the grammar does not allow was appended


class GrammarBook:
    """The grammars of one scheduler's requests. Built on first use: a worker that never sees a grammar
    never imports xgrammar or loads its tokenizer tables."""

    def __init__(self, model_path: Path | None, vocab: int, stop_ids: Sequence[int], fill_threads: int = 1) -> None:
        self.model_path = model_path
        # One: xgrammar's batch fill on 8 threads took 1.5x the time of one thread (H200 host, 128 JSON rows:
        # bench/RESULTS.md); a row takes ~20 us, less than handing it to a thread.
        self.fill_threads = fill_threads
        self.vocab = vocab
        self.stop_ids = sorted(stop_ids)
        self._compiler: Any = None
        self._batch: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        # The fill thread compiles too (a matcher made for a replay): the LRU's reorder and eviction must not
        # interleave with the scheduler thread's, or move_to_end meets a key the other just evicted.
        self._compiled_lock = threading.Lock()
        self._matching: weakref.WeakKeyDictionary[Req, _Matching] = weakref.WeakKeyDictionary()
        self._last_rows: tuple[tuple[Req, ...], list[int], list[_Matching]] | None = None

    # ---- compiling -------------------------------------------------------------------------------
    def _xgr_compiler(self) -> Any:
        if self._compiler is None:
            if self.model_path is None:
                raise GrammarError(
                    "structured output needs the model's tokenizer; this worker has none (dummy weights)"
                )
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_path)
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab, stop_token_ids=self.stop_ids)
            threads = max(1, min(8, os.cpu_count() or 1))
            self._compiler = xgr.GrammarCompiler(info, max_threads=threads)
            self._batch = xgr.BatchGrammarMatcher(max_threads=self.fill_threads)
        return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar for `spec` (cached); GrammarError when it does not compile."""
        key = (spec.kind, spec.value)
        with self._compiled_lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        compiler = self._xgr_compiler()
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
        with self._compiled_lock:
            self._compiled[key] = compiled
            if len(self._compiled) > _CACHE_ENTRIES:
                self._compiled.popitem(last=False)
        return compiled

    # ---- matching --------------------------------------------------------------------------------
    def _state(self, req: Req) -> _Matching:
        st = self._matching.get(req)
        if st is None:
            import xgrammar as xgr

            assert req.sampling.grammar is not None
            st = _Matching(xgr.GrammarMatcher(self.compile(req.sampling.grammar)), req.req_id)
            self._matching[req] = st
        return st

    def advance(self, req: Req) -> bool:
        """Feeds the request's new output tokens to its matcher; False once one was not allowed. A request
        continued from another worker (`output_offset`) has its earlier output at the prompt's end."""
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
        """The grammar is complete and its stop token accepted: nothing may follow."""
        return self._state(req).matcher.is_terminated()

    def _grammar_rows(self, reqs: Sequence[Req]) -> tuple[list[int], list[_Matching]]:
        """The grammar rows of `reqs` and their matchers; the batch's of the last call again while it is the
        same (steady decoding), without a lookup per row."""
        key = tuple(reqs)
        last = self._last_rows
        if last is None or last[0] != key:
            rows = [i for i, r in enumerate(reqs) if r.sampling.grammar is not None]
            last = self._last_rows = (key, rows, [self._state(reqs[i]) for i in rows])
        return last[1], last[2]

    def fill(self, reqs: Sequence[Req], bits: torch.Tensor | None = None) -> GrammarMasks:
        """The bitmask of the tokens each grammar request in `reqs` may sample next, written into `bits`
        ([len(reqs), ceil(vocab / 32)] int32 on the host: the scheduler passes a view of the step's pinned
        staging buffer, so the masks reach the device in the step's one copy; None: a new tensor). Only the
        grammar rows are written (and read by the sampler); a grammar row that will not be filled (its
        request finishes when this step is processed, or its last token broke its grammar) allows everything.

        The matchers first accept what they have not seen yet: the scheduler leaves a decode row's token to
        this call unless it may end the request (`Scheduler._append_token`), so the step's tokens are accepted
        in one batched call here, on the fill thread with overlap on (xgrammar releases the GIL inside it).
        A request whose token accepted here broke its grammar comes back in `broken`; the scheduler finishes
        it before any later token of it is appended (a break found replaying a request's earlier output is
        found again when its first token is appended, as before)."""
        if bits is None:
            bits = torch.empty((len(reqs), (self.vocab + 31) // 32), dtype=torch.int32)
        rows, states = [], []
        for i, st in zip(*self._grammar_rows(reqs)):
            if not reqs[i].finished:
                rows.append(i)
                states.append(st)
        accepting: list[_Matching] = []
        tokens: list[int] = []
        fresh = [False] * len(rows)  # accepted a token here: not a stop token, so not terminated
        for k, (i, st) in enumerate(zip(rows, states)):
            r = reqs[i]
            out = r.output_ids
            if out and not st.broken and st.consumed == r.sampling.output_offset + len(out) - 1:
                accepting.append(st)  # the step's one new token (a decode row's: never a stop token)
                tokens.append(out[-1])
                fresh[k] = True
            else:
                self.advance(r)  # up to date already, or a replay
        broken: list[Req] = []
        if accepting:
            ok = _batch_accept([st.matcher for st in accepting], tokens)
            for st in accepting:
                st.consumed += 1
            if ok is not None:
                for i, st, good in zip([i for k, i in enumerate(rows) if fresh[k]], accepting, ok):
                    if not good:
                        st.broken = True
                        broken.append(reqs[i])
                        log.warning("token outside the grammar", extra={"req_id": st.req_id})
        done = [False] * len(reqs)
        matchers = []
        for k, (i, st) in enumerate(zip(rows, states)):
            if not st.broken and (fresh[k] or not st.matcher.is_terminated()):
                matchers.append((i, st.matcher))
                continue
            bits[i].fill_(-1)  # it finishes when this step is processed (or now: `broken`); its row stays free
        if matchers:
            self._xgr_compiler()
            self._batch.batch_fill_next_token_bitmask([m for _, m in matchers], bits, indices=[i for i, _ in matchers])
        for i, m in matchers:
            if m.is_completed():  # rare: is anything but a stop token allowed?
                row = bits[i].clone()
                for t in self.stop_ids:
                    cleared = 0xFFFFFFFF ^ (1 << (t % 32))  # as an int32: the sign bit is bit 31
                    row[t // 32] &= cleared - (1 << 32) if cleared >= 1 << 31 else cleared
                done[i] = not bool(row.any())
        return GrammarMasks(bits, rows, done, broken)


@dataclass
class GrammarMasks:
    bits: torch.Tensor  # [B, ceil(vocab / 32)] int32 on the host
    rows: list[int]  # the rows under a grammar
    done: list[bool]  # per row: the grammar allows nothing but its end
    broken: list[Req]  # requests whose last token the grammar did not allow (they finish with an error)


def _batch_accept(matchers: list[Any], tokens: list[int]) -> list[bool] | None:
    """Each matcher accepts its token, in one call that releases the GIL; None: all were allowed, else whether
    each was. xgrammar's own wrapper turns the result into a list one element at a time through its FFI
    (~2 us a row, holding the GIL): the common all-allowed case asks the result once instead."""
    try:
        from xgrammar.base import _core
    except ImportError:  # another xgrammar layout: its public wrapper
        import xgrammar as xgr

        ok = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        return None if all(ok) else ok
    result = _core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
    rejected = 0 in result or False in result  # its elements are 0 or 1 (ints) in this build
    return [bool(v) for v in result] if rejected else None


def _first_line(exc: BaseException) -> str:
    """xgrammar's messages start with a time and a C++ source location: keep what follows them."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return _SOURCE_PREFIX.sub("", text) or type(exc).__name__
