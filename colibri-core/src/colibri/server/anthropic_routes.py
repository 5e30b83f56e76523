"""The Anthropic Messages route (``POST /v1/messages``), its SSE event names and its error envelope."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from .errors import anthropic_error_type
from ..output_parser import REASONING, TextEvent, ToolCallEvent
from .generation import Failed, Finished, GenerationRun
from .hangup import HangUpWatch
from .replies import ReplyParser, call_id, finish_reason, formatted_stream, reply_to_completion
from .sse import EventStreamResponse, event_frame
from .validation import parse_messages

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}


def _stop_reason(finished: Finished, reply: ReplyParser) -> str:
    if finished.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason(finished, reply), "end_turn")


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
    # Anthropic counts cache reads apart from input_tokens: the prompt is input + cache_read (+ cache_creation).
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_use(event: ToolCallEvent) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id(event, "toolu_"), "name": event.call.name,
            "input": json.loads(event.call.arguments)}


async def messages(request: Request):
    app = request.app
    data = await app.state.read_json(request)
    spec = parse_messages(data, app.state.config.model_id, app.state.config.kv_slots,
                          tools_supported=app.state.tools_supported,
                          thinking_switch=getattr(app.state.services.codec, "thinking_switch", None))
    run = GenerationRun(app.state.services, spec, "messages", HangUpWatch(request.receive).start())
    await run.start()
    mid = "msg_" + uuid.uuid4().hex[:24]
    model_id = app.state.config.model_id
    reply = ReplyParser(run)
    if spec.stream:
        return EventStreamResponse(_stream(run, reply, mid, model_id), run.hangup)
    parsed, events, finished = await reply_to_completion(run, reply)
    content: list[dict[str, Any]] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not parsed.tool_calls:
        content.append({"type": "text", "text": parsed.content})
    content += [_tool_use(e) for e in events if isinstance(e, ToolCallEvent)]
    u = finished.usage
    return JSONResponse({
        "id": mid, "type": "message", "role": "assistant", "model": model_id, "content": content,
        "stop_reason": _stop_reason(finished, reply), "stop_sequence": finished.stop_sequence,
        "usage": _usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens),
    })


async def count_tokens(request: Request) -> JSONResponse:
    """``POST /v1/messages/count_tokens``: the prompt tokens the same ``/v1/messages`` body would take, rendered
    and tokenized exactly as a generation renders it. A prompt that could not fit the context is refused by its
    length first, as a generation is, so a huge body costs its bytes and not the tokenizer's memory."""
    app = request.app
    data = await app.state.read_json(request)
    spec = parse_messages(data, app.state.config.model_id, app.state.config.kv_slots,
                          tools_supported=app.state.tools_supported,
                          thinking_switch=getattr(app.state.services.codec, "thinking_switch", None),
                          count_only=True)
    run = GenerationRun(app.state.services, spec, "messages", HangUpWatch(request.receive))
    async with app.state.tokenizer_gate:
        await asyncio.to_thread(run.measure)
        await asyncio.to_thread(run.prepare)
    return JSONResponse({"input_tokens": len(run.prompt_ids)})


class _Blocks:
    """The content blocks of a streamed reply: a new block starts whenever the kind of output changes."""

    def __init__(self, reply: ReplyParser):
        self.reply = reply
        self.index = -1
        self.open: str | None = None     # "thinking" or "text" while such a block is open

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event_frame("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def start(self, block: dict[str, Any]) -> list[bytes]:
        frames = self.stop()
        self.index += 1
        self.open = block["type"] if block["type"] in ("thinking", "text") else None
        frames.append(event_frame("content_block_start", {"type": "content_block_start", "index": self.index,
                                                          "content_block": block}))
        if self.index == 0:     # Anthropic's own order: message_start, the first block's start, ping
            frames.append(event_frame("ping", {"type": "ping"}))
        return frames

    def delta(self, delta: dict[str, Any]) -> bytes:
        return event_frame("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": delta})

    def text(self, event: TextEvent) -> list[bytes]:
        kind = "thinking" if event.channel == REASONING else "text"
        frames = [] if self.open == kind else self.start(
            {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text",
                                                                                           "text": ""})
        field = "thinking" if kind == "thinking" else "text"
        return frames + [self.delta({"type": f"{kind}_delta", field: event.text})]

    def call(self, event: ToolCallEvent) -> list[bytes]:
        block = _tool_use(event)
        arguments = event.call.arguments
        frames = self.start({**block, "input": {}})
        frames.append(self.delta({"type": "input_json_delta", "partial_json": arguments}))
        frames.append(event_frame("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        return frames


    def finished(self, item: Finished) -> list[bytes]:
        u = item.usage
        frames = self.start({"type": "text", "text": ""}) if self.index < 0 else []   # an empty reply: one empty block
        frames += self.stop()
        frames.append(event_frame("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": _stop_reason(item, self.reply), "stop_sequence": item.stop_sequence},
            "usage": _usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)}))
        frames.append(event_frame("message_stop", {"type": "message_stop"}))
        return frames

    def failed(self, item: Failed) -> list[bytes]:
        error = item.error
        kind = "overloaded_error" if error.status in (429, 503) else anthropic_error_type(error.status)
        return [event_frame("error", {"type": "error", "error": {"type": kind, "message": error.message}})]


def _stream(run: GenerationRun, reply: ReplyParser, mid: str, model_id: str) -> AsyncIterator[bytes]:
    cached = int(run.accept.get("reused_tokens", 0) or 0)
    opening = event_frame("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model_id, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": _usage(len(run.prompt_ids), cached, 0)}})
    return formatted_stream(run, reply, _Blocks(reply), [opening],
                            keepalive=lambda: event_frame("ping", {"type": "ping"}))
