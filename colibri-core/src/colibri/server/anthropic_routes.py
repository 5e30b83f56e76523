"""The Anthropic Messages route (``POST /v1/messages``), its SSE event names and its error envelope."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from .errors import anthropic_error_type
from .generation import (
    Delta,
    Failed,
    Finished,
    GenerationRun,
    KeepAlive,
    run_to_completion,
)
from .hangup import HangUpWatch
from .sse import EventStreamResponse, event_frame
from .validation import parse_messages

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def _stop_reason(finished: Finished) -> str:
    return "stop_sequence" if finished.stop_sequence is not None else STOP_REASONS.get(finished.reason, "end_turn")


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
    # Anthropic counts cache reads apart from input_tokens: the prompt is input + cache_read (+ cache_creation).
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def messages(request: Request):
    app = request.app
    data = await app.state.read_json(request)
    spec = parse_messages(data, app.state.config.model_id, app.state.config.kv_slots,
                          tools_supported=app.state.tools_supported)
    run = GenerationRun(app.state.services, spec, "messages", HangUpWatch(request.receive).start())
    await run.start()
    mid = "msg_" + uuid.uuid4().hex[:24]
    model_id = app.state.config.model_id
    if spec.stream:
        return EventStreamResponse(_stream(run, mid, model_id), run.hangup)
    text, finished = await run_to_completion(run)
    u = finished.usage
    return JSONResponse({
        "id": mid, "type": "message", "role": "assistant", "model": model_id,
        "content": [{"type": "text", "text": text}],
        "stop_reason": _stop_reason(finished), "stop_sequence": finished.stop_sequence,
        "usage": _usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens),
    })


async def _stream(run: GenerationRun, mid: str, model_id: str) -> AsyncIterator[bytes]:
    prompt_tokens = len(run.prompt_ids)
    cached = int(run.accept.get("reused_tokens", 0) or 0)
    try:
        yield event_frame("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model_id, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt_tokens, cached, 0)}})
        yield event_frame("content_block_start", {"type": "content_block_start", "index": 0,
                                                  "content_block": {"type": "text", "text": ""}})
        yield event_frame("ping", {"type": "ping"})
        async for item in run.stream():
            if isinstance(item, Delta):
                yield event_frame("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                          "delta": {"type": "text_delta", "text": item.text}})
            elif isinstance(item, KeepAlive):
                yield event_frame("ping", {"type": "ping"})
            elif isinstance(item, Finished):
                u = item.usage
                yield event_frame("content_block_stop", {"type": "content_block_stop", "index": 0})
                yield event_frame("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(item), "stop_sequence": item.stop_sequence},
                    "usage": _usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)})
                yield event_frame("message_stop", {"type": "message_stop"})
                return
            elif isinstance(item, Failed):
                error = item.error
                kind = "overloaded_error" if error.status in (429, 503) else anthropic_error_type(error.status)
                yield event_frame("error", {"type": "error", "error": {"type": kind, "message": error.message}})
                return
    finally:
        run.close()
