"""One choice's output: worker token events in, text deltas (with stop strings applied) out.

The decode worker streams token ids; this turns them into the text a client sees: incremental
detokenization, stop strings cut out, finish reasons in OpenAI's vocabulary, and the per-token data
that logprobs need. It is transport-free, so streaming and non-streaming responses share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.protocol import TokenLine
from router.surface.detokenizer import IncrementalDetokenizer, StopMatcher
from router.surface.tokenizer import RouterTokenizer

__all__ = ["ChoiceDelta", "ChoiceState", "TokenInfo"]


@dataclass(frozen=True)
class TokenInfo:
    """A generated token with its logprob and the top alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)  # only when logprobs were asked for
    finish_reason: str | None = None  # stop | length | error
    error: str | None = None
    completion_tokens: int = 0  # the choice's tokens up to and including this delta's

    @property
    def empty(self) -> bool:
        return not self.text and not self.tokens and self.finish_reason is None


class ChoiceState:
    def __init__(
        self,
        index: int,
        tokenizer: RouterTokenizer,
        stops: Sequence[str] = (),
        context_ids: Sequence[int] = (),
        logprobs: bool = False,
    ) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer.decode, context_ids)
        self.stop = StopMatcher(stops) if stops else None
        self.want_logprobs = logprobs
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.invalid_request = False  # the error was the request's own fault (a 400)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, ev: TokenLine) -> ChoiceDelta:
        """Consumes one worker event. After a finish (including a stop string found here) the caller
        closes the upstream stream and feeds nothing more."""
        if ev.prompt_tokens:
            self.prompt_tokens = ev.prompt_tokens
            self.cached_tokens = ev.cached_tokens
        delta = ChoiceDelta(self.index)
        ids = ev.token_ids
        self.completion_tokens += len(ids)
        if self.want_logprobs and ids:
            lps = ev.logprobs or []
            for i, tid in enumerate(ids):
                if i < len(lps):
                    delta.tokens.append(TokenInfo(tid, lps[i].logprob, tuple(lps[i].top)))
                else:
                    delta.tokens.append(TokenInfo(tid, 0.0, ()))
        text = self.detok.push(ids)
        ended = ev.finish_reason is not None
        if ended:
            text += self.detok.flush()
        if self.stop is not None:
            text = self.stop.push(text)
            if self.stop.stopped:
                self.finish_reason = "stop"
            elif ended:
                text += self.stop.flush()
        if self.finish_reason is None and ended:
            if ev.finish_reason in ("error", "abort"):
                # "abort": the worker ended it without the router asking (the router's own aborts close the
                # stream, which nobody reads on): a cut, never to look like a normal finish.
                self.finish_reason = "error"
                self.error = ev.error or (
                    "generation failed" if ev.finish_reason == "error" else "the request was aborted on its worker"
                )
                delta.error = self.error
                self.invalid_request = ev.invalid_request
            elif ev.finish_reason == "length":
                self.finish_reason = "length"
            else:  # "stop": EOS or a stop token
                self.finish_reason = "stop"
        delta.text = text
        delta.finish_reason = self.finish_reason
        delta.completion_tokens = self.completion_tokens
        return delta
