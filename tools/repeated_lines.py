#!/usr/bin/env python3
"""Count repeated code lines the way issue #16 did: normalized 4-line windows.

A file is reduced to its code lines: comments dropped (``#`` comments and docstrings in Python; ``//`` and
``/* */`` in C), whitespace collapsed, blank lines removed. Every run of ``--window`` consecutive code lines is a
window; a code line counts as *repeated* when some window that contains it occurs again anywhere in the set (in
another file or elsewhere in the same one). The figure is "repeated of total code lines", per set.

This is the measure behind the acceptance "repeated code down to a third": it is deliberately literal (exact text
after normalization, no renaming), so it counts copies, not code of the same shape. ``duplicates`` (on PATH) finds
the shape-alike pairs; this script gives the number to compare across commits.

Usage::

    python3 tools/repeated_lines.py --set plugins 'colibri-*/src/*/plugin.py' \
        --set engines 'colibri-*/src/*/engine/*.c' 'colibri-core/src/colibri/runtime/*.[ch]'

``--set NAME GLOB...`` may repeat; globs are relative to ``--root`` (default: the repository). ``--list`` prints
the repeated lines with their file and line number. Exit status is 0; the figures go to stdout.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import token
import tokenize
from collections import defaultdict
from pathlib import Path

WINDOW = 4


def _python_code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, normalized text) of a Python file's code lines, comments and docstrings dropped."""
    drop: set[int] = set()
    strip_from: dict[int, int] = {}
    previous = token.NEWLINE
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                row, col = tok.start
                strip_from[row] = min(col, strip_from.get(row, col))
            elif tok.type == token.STRING and previous in (token.NEWLINE, token.INDENT, token.DEDENT, tokenize.NL):
                # A string that is a whole statement is a docstring (or prose): not code.
                drop.update(range(tok.start[0], tok.end[0] + 1))
            if tok.type not in (tokenize.COMMENT, tokenize.NL):
                previous = tok.type
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # an unparsable file is counted by the comment-free text it has
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        if number in drop:
            continue
        if number in strip_from:
            line = line[: strip_from[number]]
        lines.append((number, line))
    return lines


def _strip_c_comments(text: str) -> str:
    """``text`` with C comments blanked out (newlines kept so line numbers hold), strings left alone."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def code_lines(path: Path) -> list[tuple[int, str]]:
    """The normalized, non-blank code lines of one file, with their 1-based line numbers."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".py":
        numbered = _python_code_lines(text)
    else:
        numbered = list(enumerate(_strip_c_comments(text).splitlines(), start=1))
    result = []
    for number, line in numbered:
        normalized = re.sub(r"\s+", " ", line).strip()
        if normalized:
            result.append((number, normalized))
    return result


def repeated(files: list[Path], window: int = WINDOW) -> tuple[int, int, dict[Path, list[int]]]:
    """(repeated code lines, total code lines, repeated line numbers per file) over ``files``."""
    per_file = {path: code_lines(path) for path in files}
    seen: dict[tuple[str, ...], int] = defaultdict(int)
    for lines in per_file.values():
        texts = [text for _, text in lines]
        for start in range(len(texts) - window + 1):
            seen[tuple(texts[start : start + window])] += 1
    total = 0
    hits: dict[Path, list[int]] = {}
    for path, lines in per_file.items():
        texts = [text for _, text in lines]
        marked = [False] * len(texts)
        for start in range(len(texts) - window + 1):
            if seen[tuple(texts[start : start + window])] > 1:
                for k in range(start, start + window):
                    marked[k] = True
        total += len(texts)
        hits[path] = [lines[k][0] for k in range(len(texts)) if marked[k]]
    return sum(len(v) for v in hits.values()), total, hits


def _expand(root: Path, globs: list[str]) -> list[Path]:
    found: set[Path] = set()
    for pattern in globs:
        found.update(p for p in root.glob(pattern) if p.is_file())
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--set", nargs="+", action="append", metavar=("NAME", "GLOB"), required=True,
                        help="a named set of files: NAME then one or more globs relative to --root")
    parser.add_argument("--window", type=int, default=WINDOW, help="lines per window (default 4)")
    parser.add_argument("--list", action="store_true", help="print each repeated line's file:line")
    args = parser.parse_args(argv)
    for name, *globs in args.set:
        files = _expand(args.root, globs)
        if not files:
            print(f"error: set {name!r} matches no file under {args.root} (check the globs)", file=sys.stderr)
            return 1
        count, total, hits = repeated(files, args.window)
        share = 100.0 * count / total if total else 0.0
        print(f"{name}: {count} of {total} code lines repeated ({share:.1f} %) in {len(files)} files")
        if args.list:
            for path, numbers in hits.items():
                for number in numbers:
                    print(f"  {path.relative_to(args.root)}:{number}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
