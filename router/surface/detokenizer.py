"""Token ids -> text, one token at a time, and stop strings matched on that text.

Why incremental decoding needs care: one character can span several tokens (byte-level BPE splits an
emoji or a CJK character into byte tokens; SentencePiece uses ``<0xNN>`` byte fallback), and decoding a
token alone loses context (SentencePiece drops the leading space of a sequence's first word). So we
decode a small sliding window of ids and emit only what the window adds beyond its already-emitted
head, and we hold text back while it ends in U+FFFD (an incomplete UTF-8 sequence that the next token
may finish). The concatenated deltas equal the full decode of all ids.

Stop strings are matched on the emitted text, across token boundaries: text that could be the start of
a stop string is held back until it either completes the stop string (then the text is cut before it,
as OpenAI does, and generation ends) or cannot any more (then it is released).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalDetokenizer", "StopMatcher"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids with ``push``; get back the new text they complete.

    ``decode`` maps ids to text (special tokens skipped). ``context_ids`` are the last few prompt ids:
    decoding the first output token after them keeps its leading space where a tokenizer would strip it
    at the start of a sequence; they are never emitted.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], context_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(context_ids)
        # Window: ids[_prefix:_read] were already turned into text (or are prompt context); ids from
        # _read on are not emitted yet. _prefix_text caches decode(ids[_prefix:_read]).
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = decode(self._ids) if self._ids else ""

    def push(self, ids: Sequence[int]) -> str:
        """Adds ids; returns the text they complete ("" while a character is still incomplete)."""
        if not ids:
            return ""
        self._ids.extend(ids)
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (e.g. a truly invalid byte sequence)."""
        if self._read >= len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(self._prefix_text):
            self._read = len(self._ids)
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        # Slide the window: what was unread becomes the new head, so the window stays a few tokens long.
        self._prefix = self._read
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return delta


class StopMatcher:
    """Cuts a text stream at the first occurrence of any stop string.

    ``push`` returns the part of the text that is safe to emit; a tail that might still grow into a
    stop string is held back. Once a stop string is complete, ``stopped`` is True and the returned text
    ends right before it (the stop string itself is never emitted).
    """

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
        """Generation ended without a stop string: release the held-back tail."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
