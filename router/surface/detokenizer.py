"""Token ids -> text, one token at a time, and stop strings matched on that text.

A character can span several tokens and a token decoded alone loses context (SentencePiece drops a leading
space), so a small sliding window is decoded and only what it adds is emitted, held back while it ends in
U+FFFD. Text that could start a stop string is held until it completes one (cut before it, as OpenAI does) or
cannot any more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalDetokenizer", "StopMatcher"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``push`` token ids, get back the text they complete. ``context_ids``: the last prompt ids, never emitted,
    so the first output token keeps its leading space."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(context_ids)
        # ids[_prefix:_read] are emitted (or prompt context), decoded as _prefix_text; ids from _read on are not.
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = decode(self._ids) if self._ids else ""

    def push(self, ids: Sequence[int]) -> str:
        """Adds ids; returns the text they complete ("" while a character is incomplete)."""
        if not ids:
            return ""
        self._ids.extend(ids)
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """At the end of generation: whatever is still held back."""
        if self._read >= len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(self._prefix_text):
            self._read = len(self._ids)
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        # Slide the window: the unread part becomes the new head, so it stays a few tokens long.
        self._prefix = self._read
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return delta


class StopMatcher:
    """Cuts a text stream before the first stop string: ``push`` returns the text safe to emit; once a stop
    string completes, ``stopped`` is True."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._pending = ""
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1

    def push(self, text: str) -> str:
        if self.stopped or not text:
            return ""
        buf = self._pending + text
        cut = -1
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        hold = self._partial_suffix(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """Generation ended without a stop string: releases the held-back tail."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out

    def _partial_suffix(self, buf: str) -> int:
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
