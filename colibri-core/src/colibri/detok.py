"""Streaming text out of a growing token list without ever printing half a character.

A byte-level BPE token can end in the middle of a UTF-8 sequence; decoding it alone yields U+FFFD. So each new
token re-decodes a short window (from the last point known to be a clean boundary) and emits only the part past
what was already emitted, holding everything back while the window ends in a replacement character. The window is
decoded twice from the same start, so decoders that treat the first token specially (SentencePiece's leading
space) cancel out.
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids with :meth:`push`; each call returns the newly stable text (often ``""``)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], skip_ids: Sequence[int] = ()):
        self._decode = decode
        self._skip = frozenset(skip_ids)
        self.ids: list[int] = []
        self._window_start = 0      # decode from here: a boundary where text was cleanly emitted
        self._emitted_upto = 0      # ids[:_emitted_upto] are fully reflected in the emitted text
        self.text = ""

    def push(self, token: int) -> str:
        if token in self._skip:
            return ""
        self.ids.append(int(token))
        before = self._decode(self.ids[self._window_start:self._emitted_upto])
        now = self._decode(self.ids[self._window_start:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""                      # an incomplete character (or nothing visible yet): wait
        delta = now[len(before):]
        self._window_start = self._emitted_upto
        self._emitted_upto = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is still held back (a truly invalid sequence comes out as U+FFFD here)."""
        before = self._decode(self.ids[self._window_start:self._emitted_upto])
        now = self._decode(self.ids[self._window_start:])
        delta = now[len(before):] if len(now) > len(before) else ""
        self._window_start = self._emitted_upto = len(self.ids)
        self.text += delta
        return delta
