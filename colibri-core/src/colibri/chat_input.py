"""Reading chat messages from a person (readline, history) or a pipe, with multi-line input.

A line ending in a backslash continues on the next line; a line that is just ``\"\"\"`` opens a block that the next
such line closes (text may also follow the opening quotes or precede the closing ones, as when pasting).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

BLOCK = '"""'
PROMPT = ">>> "
CONTINUE = "... "


class LineSource:
    """``read(prompt)`` returns one line without its newline, or raises EOFError at the end of input."""

    def __init__(self, interactive: bool, history_file: Path | None = None):
        self.interactive = interactive
        self.history_file = history_file
        self._readline: Any = None   # the readline module, when history is on
        if interactive and history_file is not None:
            self._setup_history(history_file)

    def _setup_history(self, path: Path) -> None:
        try:
            import readline
        except ImportError:  # pragma: no cover - platforms without GNU readline
            return
        self._readline = readline
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                readline.read_history_file(str(path))
        except OSError:
            pass
        readline.set_history_length(1000)

    def save_history(self) -> None:
        if self._readline is not None and self.history_file is not None:
            try:
                self._readline.write_history_file(str(self.history_file))
            except OSError:
                pass

    def read(self, prompt: str) -> str:
        if self.interactive:
            return input(prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n").rstrip("\r")


def read_message(read: Callable[[str], str]) -> str:
    """One message, possibly spanning lines. EOFError propagates (the caller ends the chat)."""
    first = read(PROMPT)
    stripped = first.strip()
    if stripped.startswith(BLOCK):
        opening = stripped[len(BLOCK):]
        if opening.endswith(BLOCK) and len(opening) >= len(BLOCK):
            return opening[:-len(BLOCK)]
        lines = [opening] if opening else []
        while True:
            try:
                line = read(CONTINUE)
            except EOFError:
                break                                    # an unclosed block at the end of input still counts
            if line.rstrip().endswith(BLOCK):
                tail = line.rstrip()[:-len(BLOCK)]
                if tail:
                    lines.append(tail)
                break
            lines.append(line)
        return "\n".join(lines)
    lines = []
    line = first
    while line.endswith("\\"):
        lines.append(line[:-1])
        try:
            line = read(CONTINUE)
        except EOFError:
            line = ""
            break
    lines.append(line)
    return "\n".join(lines)
