"""A generation's text as the routes answer it: reasoning apart from the answer, and tool calls, through the
family's ``parse_output`` parser (plain answer text when the family has none).

Stop sequences are matched on the raw text first (in :mod:`.generation`); the parser sees what is left.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from ..output_parser import CONTENT, ParsedOutput, TextEvent, ToolCallEvent, collect, prompt_opens_reasoning
from .generation import Delta, Failed, Finished, GenerationRun, KeepAlive, run_to_completion

ReplyEvent = TextEvent | ToolCallEvent


class StreamFormat(Protocol):
    """A dialect's frames for each kind of item of a streamed reply."""

    def text(self, event: TextEvent) -> list[bytes]: ...

    def call(self, event: ToolCallEvent) -> list[bytes]: ...

    def finished(self, item: Finished) -> list[bytes]: ...

    def failed(self, item: Failed) -> list[bytes]: ...


class ReplyParser:
    """One reply's parser, set up for the request: its tools, ``tool_choice``, ``parallel_tool_calls``, and
    whether its rendered prompt left a reasoning block open."""

    def __init__(self, run: GenerationRun):
        spec = run.spec
        self.parallel = spec.parallel_tool_calls
        make = getattr(run.s.codec, "output_parser", None)
        parser = make() if make is not None and spec.messages is not None else None
        if parser is not None:
            parser.begin(spec.tools, prompt_opens_reasoning(parser.syntax, run.prompt_tail))
            if not spec.tools or spec.tool_choice == "none":
                parser.without_tools()
        self.parser = parser
        self.calls = 0

    def feed(self, text: str) -> list[ReplyEvent]:
        if self.parser is None:
            return [TextEvent(CONTENT, text)] if text else []
        return self._limit(self.parser.feed(text))

    def finish(self) -> list[ReplyEvent]:
        return [] if self.parser is None else self._limit(self.parser.finish())

    def _limit(self, events: list[ReplyEvent]) -> list[ReplyEvent]:
        kept = []
        for event in events:
            if isinstance(event, ToolCallEvent):
                if self.calls and not self.parallel:
                    continue    # parallel_tool_calls false: the first call only
                self.calls += 1
            kept.append(event)
        return kept


def finish_reason(finished: Finished, reply: ReplyParser) -> str:
    return "tool_calls" if reply.calls and finished.reason == "stop" else finished.reason


def call_id(event: ToolCallEvent, prefix: str) -> str:
    """The model's own id when its syntax has one (Kimi's ``functions.name:0``, written back into the next
    prompt), else a fresh one."""
    return event.call.id or f"{prefix}{uuid.uuid4().hex[:24]}"


async def reply_stream(run: GenerationRun, reply: ReplyParser
                       ) -> AsyncIterator[ReplyEvent | KeepAlive | Finished | Failed]:
    async for item in run.stream():
        if isinstance(item, Delta):
            for event in reply.feed(item.text):
                yield event
        elif isinstance(item, Finished):
            for event in reply.finish():
                yield event
            yield item
        else:
            yield item


async def reply_to_completion(run: GenerationRun, reply: ReplyParser) -> tuple[ParsedOutput, list[ReplyEvent],
                                                                             Finished]:
    text, finished = await run_to_completion(run)
    events = reply.feed(text) + reply.finish()
    return collect(events), events, finished


def tool_call_body(event: ToolCallEvent, call_ids: dict[int, str], index: int | None = None) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry (with ``index`` when streamed)."""
    body: dict[str, Any] = {"id": call_ids.setdefault(event.index, call_id(event, "call_")), "type": "function",
                            "function": {"name": event.call.name, "arguments": event.call.arguments}}
    if index is not None:
        body = {"index": index, **body}
    return body


async def formatted_stream(run: GenerationRun, reply: ReplyParser, fmt: StreamFormat, opening: Sequence[bytes],
                           keepalive: Callable[[], bytes]) -> AsyncIterator[bytes]:
    """A streamed reply in one dialect: its opening frames, each item's frames, until the reply is finished or
    failed; the run is closed however the stream ends (a hang-up included)."""
    try:
        for frame in opening:
            yield frame
        async for item in reply_stream(run, reply):
            if isinstance(item, TextEvent):
                frames = fmt.text(item)
            elif isinstance(item, ToolCallEvent):
                frames = fmt.call(item)
            elif isinstance(item, KeepAlive):
                frames = [keepalive()]
            elif isinstance(item, Finished):
                frames = fmt.finished(item)
            else:
                frames = fmt.failed(item)
            for frame in frames:
                yield frame
            if isinstance(item, (Finished, Failed)):
                return
    finally:
        run.close()
