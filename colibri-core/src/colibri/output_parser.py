"""Splitting a model's streamed output into reasoning, answer text and tool calls.

One engine for every family: a family describes its output syntax as a table (:class:`OutputSyntax`: the
reasoning markers, and each tool-call section's open and close markers with a function that decodes a complete
section's body into calls), and :class:`OutputParser` turns text, fed in chunks of any size, into events.

Nothing that might be the start of a marker is released: a tail of the text that is a proper prefix of any marker
is held until the next chunk settles it, so a client never sees half of ``<tool_call>`` as content. A tool-call
section is buffered whole and decoded once its close marker arrives (a call's arguments are only valid JSON
then); a section the model never closes is released as plain content at the end, so no text is lost.

The events are the same whatever the chunking: feeding ``"ab"`` then ``"c"`` and feeding ``"abc"`` give the same
sequence once adjacent text events of one channel are joined (:func:`merge_events`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

REASONING = "reasoning"
CONTENT = "content"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; ``arguments`` is a JSON object text (OpenAI's shape), ``id`` empty unless the syntax
    carries one (Kimi's ``functions.name:0``)."""

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True)
class TextEvent:
    channel: str    # REASONING or CONTENT
    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    index: int      # 0, 1, ... in the order the model wrote them
    call: ToolCall


SectionDecoder = Callable[[str, "ToolSchemas"], "list[ToolCall] | None"]


@dataclass(frozen=True)
class ToolSection:
    """A tool-call region: ``open`` ... ``close``; ``decode`` turns its body into calls (``None``: malformed)."""

    open: str
    close: str
    decode: SectionDecoder


@dataclass(frozen=True)
class OutputSyntax:
    """A family's output syntax: reasoning markers (empty: none), its tool-call sections, and optionally
    ``call_grammar(name, parameters)``: the Lark expression of one call in this syntax, which forced tool calls
    are constrained to (:mod:`colibri.call_grammar`; None: this family cannot force a call)."""

    reasoning_open: str = ""
    reasoning_close: str = ""
    tool_sections: tuple[ToolSection, ...] = ()
    call_grammar: Callable[[str, Mapping[str, Any]], str] | None = None

    @property
    def has_tools(self) -> bool:
        return bool(self.tool_sections)

    @property
    def markers(self) -> tuple[str, ...]:
        found = [self.reasoning_open, self.reasoning_close]
        for section in self.tool_sections:
            found += [section.open, section.close]
        return tuple(m for m in found if m)


class ToolSchemas:
    """The request's ``tools``, by function name: lets a decoder type an argument the syntax leaves untyped."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None):
        self._params: dict[str, Mapping[str, Any]] = {}
        for tool in tools or ():
            function = tool.get("function", tool) if isinstance(tool, Mapping) else {}
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                params = function.get("parameters") or function.get("input_schema") or {}
                props = params.get("properties") if isinstance(params, Mapping) else None
                self._params[function["name"]] = props if isinstance(props, Mapping) else {}

    def is_string(self, function: str, argument: str) -> bool | None:
        """``True``/``False`` when the schema says whether the argument is a string; ``None`` when it is silent."""
        schema = self._params.get(function, {}).get(argument)
        if not isinstance(schema, Mapping) or "type" not in schema:
            return None
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return "string" in kinds


def argument_value(raw: str, function: str, argument: str, schemas: ToolSchemas) -> Any:
    """An argument written as bare text (GLM's ``<arg_value>``, Qwen's ``<parameter=...>``): templates write
    strings as they are and everything else as JSON, so a string-typed argument stays text and any other is
    read as JSON when it parses."""
    if schemas.is_string(function, argument):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def json_arguments(raw: str) -> str | None:
    """A call's arguments given as JSON text, normalized to a JSON object's text; ``None`` when not an object."""
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def dump_arguments(values: Mapping[str, Any]) -> str:
    return json.dumps(dict(values), ensure_ascii=False)


def delimited(body: str, begin: str, end: str) -> list[str] | None:
    """The pieces of ``body`` written as ``begin piece end`` one after another (whitespace between is allowed);
    ``None`` when anything else stands outside them or a piece is not closed."""
    pieces, rest = [], body
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(begin):
            return None
        piece, found, rest = rest[len(begin):].partition(end)
        if not found:
            return None
        pieces.append(piece)
    return pieces


def consecutive(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """The matches of ``pattern`` written one after another over the whole of ``text`` (whitespace between and
    after is allowed); ``None`` when anything else stands between them."""
    found, at = [], 0
    for match in pattern.finditer(text):
        if text[at:match.start()].strip():
            return None
        found.append(match)
        at = match.end()
    return None if text[at:].strip() else found


def repeated(begin: str, end: str, one: Callable[[str], ToolCall | None]) -> SectionDecoder:
    """A section decoder for calls written ``begin call end`` one after another (DeepSeek's, Kimi's), each
    decoded by ``one``; the section is malformed when any call is."""
    def decode(body: str, schemas: ToolSchemas) -> list[ToolCall] | None:
        calls = [one(piece) for piece in delimited(body, begin, end) or ()]
        whole = [call for call in calls if call is not None]
        return whole if whole and len(whole) == len(calls) else None
    return decode


def pairs(body: str, open_a: str, close_a: str, open_b: str, close_b: str) -> list[tuple[str, str]] | None:
    """``open_a key close_a open_b value close_b`` repeated (GLM's argument pairs); ``None`` when malformed."""
    keys = delimited(body, open_a, close_b)
    if keys is None:
        return None
    found = []
    for piece in keys:
        key, sep, value = piece.partition(close_a)
        value = value.strip()
        if not sep or not value.startswith(open_b):
            return None
        found.append((key.strip(), value[len(open_b):]))
    return found


@dataclass
class _State:
    channel: str = CONTENT
    section: ToolSection | None = None
    body: list[str] = field(default_factory=list)


class OutputParser:
    """Incremental parser for one generation. ``feed(text)`` and ``finish()`` return lists of events."""

    def __init__(self, syntax: OutputSyntax):
        self.syntax = syntax
        self.schemas = ToolSchemas()
        self._pending = ""
        self._state = _State()
        self._calls = 0
        # nothing shown yet in a segment that follows a marker (its leading newlines are the template's layout,
        # not text); the reply's opening text is passed as it is, so a reply without markers is left unchanged
        self._segment_empty = False
        self._held_space = ""          # trailing whitespace of the content, shown only when more text follows

    def begin(self, tools: Sequence[Mapping[str, Any]] | None = None, in_reasoning: bool = False) -> OutputParser:
        """Set the request's context before feeding: its tools, and whether the prompt left reasoning open."""
        self.schemas = ToolSchemas(tools)
        if in_reasoning and self.syntax.reasoning_close:
            self._state.channel, self._segment_empty = REASONING, True
        return self

    def without_tools(self) -> OutputParser:
        """The same parser with tool-call recognition off (``tool_choice: none``): calls stay plain text."""
        self.syntax = OutputSyntax(self.syntax.reasoning_open, self.syntax.reasoning_close)
        return self

    def feed(self, text: str) -> list[TextEvent | ToolCallEvent]:
        self._pending += text
        out: list[TextEvent | ToolCallEvent] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[TextEvent | ToolCallEvent]:
        """The end of generation: release what was held (an unclosed section is plain content after all)."""
        out: list[TextEvent | ToolCallEvent] = []
        state = self._state
        if state.section is not None:
            raw = state.section.open + "".join(state.body) + self._pending
            state.section, state.body, self._pending = None, [], ""
            state.channel = CONTENT
            self._emit(out, raw)
        elif self._pending:
            self._emit(out, self._pending)
            self._pending = ""
        if self._held_space and not self._calls:
            out.append(TextEvent(CONTENT, self._held_space))
        self._held_space = ""
        return out

    # ---- the state machine ----------------------------------------------------------------------------------

    def _wanted(self) -> list[tuple[str, Any]]:
        """The markers that end the current text, with what each one does."""
        state, syntax = self._state, self.syntax
        if state.section is not None:
            return [(state.section.close, "close")]
        wanted: list[tuple[str, Any]]
        if state.channel == REASONING:
            wanted = [(syntax.reasoning_close, "end_reasoning")]
            if self._segment_empty:     # the prompt opened the block and the model opens it again: not text
                wanted.append((syntax.reasoning_open, "reopen_reasoning"))
            return wanted
        wanted = [(s.open, s) for s in syntax.tool_sections]
        if syntax.reasoning_open:
            wanted.append((syntax.reasoning_open, "start_reasoning"))
        return wanted

    def _step(self, out: list) -> bool:
        """Consume up to and including the next marker; ``False`` when none is complete in the pending text."""
        best = None
        for marker, action in self._wanted():
            at = self._pending.find(marker)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, marker, action)
        state = self._state
        if best is None:
            keep = self._held_prefix()
            ready, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
            if state.section is not None:
                state.body.append(ready)
            else:
                self._emit(out, ready)
            return False
        at, marker, action = best
        before, self._pending = self._pending[:at], self._pending[at + len(marker):]
        if action == "close":
            self._close_section(out, "".join(state.body) + before)
        elif action == "end_reasoning":
            self._emit(out, before)
            state.channel, self._segment_empty = CONTENT, True
        elif action == "reopen_reasoning":
            # dropped only where it opens the block; after reasoning text it is text itself
            self._emit(out, before if not before.strip("\n") else before + marker)
        elif action == "start_reasoning":
            self._emit(out, before)
            self._held_space = ""          # whitespace before a reasoning block is not part of the answer
            state.channel, self._segment_empty = REASONING, True
        else:
            self._emit(out, before)
            state.section, state.body = action, []
        return True

    def _close_section(self, out: list, body: str) -> None:
        section = self._state.section
        assert section is not None     # only called while a section is open
        self._state.section, self._state.body = None, []
        calls = section.decode(body, self.schemas)
        if not calls:   # malformed: show it as the model wrote it rather than drop it
            self._emit(out, section.open + body + section.close)
            return
        self._held_space = ""
        for call in calls:
            out.append(ToolCallEvent(self._calls, call))
            self._calls += 1

    def _held_prefix(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a marker."""
        text, longest = self._pending, 0
        for marker, _ in self._wanted():
            for n in range(min(len(marker) - 1, len(text)), longest, -1):
                if text.endswith(marker[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, out: list, text: str) -> None:
        channel = self._state.channel
        if self._segment_empty:
            text = text.lstrip("\n")
            if not text:
                return
            self._segment_empty = False
        if channel == CONTENT:
            text = self._held_space + text
            body = text.rstrip()
            self._held_space = text[len(body):]
            text = body
        if text:
            out.append(TextEvent(channel, text))


def merge_events(events: Sequence[TextEvent | ToolCallEvent]) -> list[TextEvent | ToolCallEvent]:
    """Adjacent text events of one channel joined (what a chunking-independent comparison needs)."""
    merged: list[TextEvent | ToolCallEvent] = []
    for event in events:
        if merged and isinstance(event, TextEvent) and isinstance(merged[-1], TextEvent) \
                and merged[-1].channel == event.channel:
            merged[-1] = TextEvent(event.channel, merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged


@dataclass
class ParsedOutput:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]


def collect(events: Sequence[TextEvent | ToolCallEvent]) -> ParsedOutput:
    """A whole reply from its events (non-streamed responses)."""
    reasoning = "".join(e.text for e in events if isinstance(e, TextEvent) and e.channel == REASONING)
    content = "".join(e.text for e in events if isinstance(e, TextEvent) and e.channel == CONTENT)
    return ParsedOutput(reasoning, content, [e.call for e in events if isinstance(e, ToolCallEvent)])


def prompt_opens_reasoning(syntax: OutputSyntax, prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open reasoning block (templates that start the assistant turn
    with ``<think>``, such as DeepSeek V3.1's thinking mode): the model's output then begins as reasoning."""
    if not syntax.reasoning_open:
        return False
    tail = prompt_text.rstrip()
    return tail.endswith(syntax.reasoning_open)
