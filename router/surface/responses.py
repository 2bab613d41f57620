"""OpenAI response bodies: chat.completion(.chunk), text_completion, usage, and both logprobs shapes (chat's
``content`` list; legacy completions' parallel ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from common.protocol import PromptLogprobs
from router.surface.choice import TokenInfo
from router.surface.tokenizer import RouterTokenizer

__all__ = [
    "chat_logprobs",
    "ChunkFormat",
    "completion_logprobs",
    "echo_logprobs",
    "joined_logprobs",
    "prompt_logprobs",
    "response",
    "sse",
    "usage",
]

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of a stream


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ---- logprobs ------------------------------------------------------------------------------------
def chat_logprobs(tokens: Sequence[TokenInfo], tok: RouterTokenizer) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tok.token_str(token_id), "logprob": logprob, "bytes": list(tok.token_bytes(token_id))}

    content = []
    for t in tokens:
        e = entry(t.token_id, t.logprob)
        e["top_logprobs"] = [entry(i, lp) for i, lp in t.top]
        content.append(e)
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: Sequence[TokenInfo], tok: RouterTokenizer, offset: int) -> tuple[dict[str, Any], int]:
    """Logprobs of tokens whose text starts at character ``offset``; returns the object and the offset after."""
    strs, lps, tops, offsets = [], [], [], []
    for t in tokens:
        s = tok.token_str(t.token_id)
        strs.append(s)
        lps.append(t.logprob)
        top: dict[str, float] = {}
        for i, lp in t.top:
            top.setdefault(tok.token_str(i), lp)  # two ids can print alike; keep the likelier
        # OpenAI's legacy shape always holds the sampled token too (up to logprobs + 1 entries; {token} for 0).
        top.setdefault(s, t.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": strs, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def echo_logprobs(
    prompt_ids: Sequence[int], scored: PromptLogprobs | None, top: int, tok: RouterTokenizer
) -> tuple[dict[str, Any], int]:
    """Completions' echo with logprobs: the prompt's tokens in the legacy shape (the first has no logprob: null
    in ``token_logprobs`` and ``top_logprobs``), up to ``top`` alternatives each; returns the object and the text
    offset after the prompt."""
    strs, offsets, offset = [], [], 0
    for tid in prompt_ids:
        s = tok.token_str(tid)
        strs.append(s)
        offsets.append(offset)
        offset += len(s)
    lps: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    if scored is None:  # nothing scored: a null per position, so every list stays as long as ``tokens``
        lps += [None] * (len(strs) - 1)
        tops += [None] * (len(strs) - 1)
    else:
        for j, lp in enumerate(scored.logprobs):
            alternatives: dict[str, float] = {}
            if top and scored.top_ids:
                for i, alt in zip(scored.top_ids[j][:top], scored.top_logprobs[j][:top]):
                    alternatives.setdefault(tok.token_str(i), alt)
            alternatives.setdefault(strs[j + 1], lp)  # the prompt's own token, as for sampled ones
            lps.append(lp)
            tops.append(alternatives)
    return {"tokens": strs, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def joined_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two legacy logprobs objects as one (the prompt's, then the output's)."""
    return {key: first[key] + then[key] for key in first}


def prompt_logprobs(
    prompt_ids: Sequence[int], scored: PromptLogprobs | None, top: int, tok: RouterTokenizer
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: null for the first token, then per position token id -> logprob, rank and
    text, for the prompt's own token and the ``top`` likeliest."""
    if scored is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for j, lp in enumerate(scored.logprobs):
        tid = prompt_ids[j + 1]
        entry = {str(tid): {"logprob": lp, "rank": scored.ranks[j], "decoded_token": tok.token_str(tid)}}
        if top and scored.top_ids:
            for rank, (i, alt) in enumerate(zip(scored.top_ids[j][:top], scored.top_logprobs[j][:top]), 1):
                entry.setdefault(str(i), {"logprob": alt, "rank": rank, "decoded_token": tok.token_str(i)})
        out.append(entry)
    return out


# ---- whole responses -----------------------------------------------------------------------------
def response(
    kind: str, rid: str, created: int, model: str, choices: list[dict[str, Any]], use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": use,
    }


def chat_choice(
    index: int,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


# ---- stream chunks -------------------------------------------------------------------------------
class ChunkFormat:
    """The SSE chunks of one streamed response: the fields every chunk repeats are rendered once, only each
    chunk's choices per token."""

    def __init__(self, object_name: str, rid: str, created: int, model: str, include_usage: bool) -> None:
        head = {"id": rid, "object": object_name, "created": created, "model": model, "system_fingerprint": None}
        self._prefix = b"data: " + orjson.dumps(head)[:-1] + b',"choices":'
        self._suffix = b',"usage":null}\n\n' if include_usage else b"}\n\n"

    def chunk(self, choices: list[dict[str, Any]], use: dict[str, Any] | None = None) -> bytes:
        """One chunk; ``use``: the usage it carries (continuous usage stats), else the stream's default."""
        tail = self._suffix if use is None else b',"usage":' + orjson.dumps(use) + b"}\n\n"
        return self._prefix + orjson.dumps(choices) + tail

    def usage_chunk(self, use: dict[str, Any]) -> bytes:
        return self.chunk([], use)
