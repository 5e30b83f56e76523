"""How ``coli run`` and ``coli chat`` show a reply: reasoning apart from the answer, through the family's
``parse_output`` parser (the one the server splits replies with).

On a terminal the reasoning is written dimmed before the answer, a blank line between them. When stdout is not
a terminal (a pipe, a file) it carries the answer alone and the reasoning goes to stderr, so a script reading
the output gets what the model answered. A family without a parser streams the text as it is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .console import _wants_colour
from .output_parser import REASONING, TextEvent, prompt_opens_reasoning

DIM, RESET = "\x1b[2m", "\x1b[0m"


class ReasoningView:
    """Streams one reply: ``feed`` each stable piece of text, then ``finish``."""

    def __init__(self, parser: Any, prompt_text: str, write: Callable[[str], None]):
        self.parser = parser
        if parser is not None:
            parser.begin(None, prompt_opens_reasoning(parser.syntax, prompt_text[-256:]))
            parser.without_tools()
        self.write = write
        self.on_terminal = _wants_colour(sys.stdout)
        self.in_reasoning = False
        self.reasoned = False
        self.answered = False

    def feed(self, text: str) -> None:
        if self.parser is None:
            self.write(text)
            return
        for event in self.parser.feed(text):
            self._show(event)

    def finish(self) -> None:
        if self.parser is not None:
            for event in self.parser.finish():
                self._show(event)
        self._leave_reasoning()

    def _show(self, event: TextEvent) -> None:     # no tools are offered, so calls come back as text
        text = event.text
        if event.channel == REASONING:
            if not self.on_terminal:
                sys.stderr.write(text)
                sys.stderr.flush()
                self.reasoned = True
                return
            if not self.in_reasoning:
                self.write(DIM)
                self.in_reasoning = True
            self.write(text)
            self.reasoned = True
            return
        self._leave_reasoning()
        if not self.answered and self.reasoned:
            text = text.lstrip("\n")      # the blank line below separates them; the model's own newlines do not
            if not text:
                return
            if self.on_terminal:
                self.write("\n\n")
            else:
                sys.stderr.write("\n")
                sys.stderr.flush()
        self.answered = True
        self.write(text)

    def _leave_reasoning(self) -> None:
        if self.in_reasoning:
            self.write(RESET)
            self.in_reasoning = False
