"""Terminal output for the ``coli`` CLI: plain text when piped, colour on a TTY, JSON when asked.

Everything a person reads goes through here so that the error line, tables and units look the same in every
command. Machine output (``--json``) bypasses rich entirely: rich would wrap long lines and add escapes.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.text import Text

STATUS_STYLES = {"pass": "green", "warn": "yellow", "fail": "red bold"}


def _wants_colour(stream) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def stdout() -> Console:
    """A console on the current ``sys.stdout`` (looked up per call: test runners swap the stream)."""
    colour = _wants_colour(sys.stdout)
    # soft_wrap: never re-wrap our lines; a path or a tensor name must stay on one line to stay greppable.
    return Console(file=sys.stdout, highlight=False, soft_wrap=True, force_terminal=colour,
                   no_color=not colour, emoji=False)


def error_line(message: str) -> str:
    """The one line every user-facing error is printed as (without colour)."""
    return f"error: {message}"


def print_error(message: str) -> None:
    """Print ``error: <message>`` on stderr: red on a TTY, plain otherwise, always one line."""
    line = error_line(" ".join(message.splitlines()))
    if _wants_colour(sys.stderr):
        line = f"\x1b[1;31m{line}\x1b[0m"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def print_warning(message: str) -> None:
    line = f"warning: {' '.join(message.splitlines())}"
    if _wants_colour(sys.stderr):
        line = f"\x1b[33m{line}\x1b[0m"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def emit_json(data: Any) -> None:
    """Write ``data`` as indented JSON on stdout (paths and tuples become strings and lists)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def print_heading(text: str) -> None:
    stdout().print(Text(text, style="bold"))


def print_pairs(pairs: Iterable[tuple[str, Any]], indent: int = 0) -> None:
    """Aligned ``label  value`` lines."""
    pairs = [(label, "" if value is None else str(value)) for label, value in pairs]
    if not pairs:
        return
    width = max(len(label) for label, _ in pairs)
    con = stdout()
    for label, value in pairs:
        line = Text(" " * indent)
        line.append(label.ljust(width), style="cyan")
        line.append("  " + value)
        con.print(line)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], styles: dict[int, Any] | None = None) -> None:
    """A plain aligned table: readable piped, coloured on a TTY. ``styles`` maps a column to a value->style dict."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    con = stdout()
    head = Text()
    for i, h in enumerate(headers):
        head.append(h.ljust(widths[i]) if i < len(headers) - 1 else h, style="bold")
        if i < len(headers) - 1:
            head.append("  ")
    con.print(head)
    for row in cells:
        line = Text()
        for i, cell in enumerate(row):
            style = (styles or {}).get(i, {}).get(cell, "")
            line.append(cell.ljust(widths[i]) if i < len(row) - 1 else cell, style=style)
            if i < len(row) - 1:
                line.append("  ")
        con.print(line)


def human_bytes(n: float) -> str:
    """Binary units, three significant digits: ``1.50 GiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.3g} {unit}" if abs(n) >= 100 else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover - loop always returns


def human_count(n: int) -> str:
    """Parameter counts: ``6.92B``, ``1.28M``, exact below a thousand."""
    for div, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)
