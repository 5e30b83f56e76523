"""Stop sequences over streamed text: a partial stop never leaks to the client.

Any tail of the text that could be the start of a stop sequence is held back until the next delta shows it is
not (then it is released) or completes it (then the text ends before the stop). Split characters are held back
one level down, by :class:`colibri.detok.IncrementalDetokenizer`.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the first stop sequence in the generated text and withholds any tail that might begin one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add generated text; return what is safe to show. After a match, :attr:`matched` is set."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        self._pending += text
        best = None
        for stop in self.stops:
            at = self._pending.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            self.matched = best[1]
            out, self._pending = self._pending[:best[0]], ""
            return out
        hold = self._held_tail_length()
        out = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        return out

    def _held_tail_length(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of some stop."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """At the end of generation a held tail was not a stop after all: release it."""
        out, self._pending = ("" if self.matched is not None else self._pending), ""
        return out
