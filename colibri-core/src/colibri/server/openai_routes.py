"""The OpenAI-compatible routes: chat completions, completions, models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from .errors import APIError
from ..output_parser import REASONING, TextEvent, ToolCallEvent
from .generation import Failed, Finished, GenerationRun, KeepAlive, Usage
from .hangup import HangUpWatch
from .replies import ReplyParser, finish_reason, reply_stream, reply_to_completion, tool_call_body
from .sse import DONE, KEEPALIVE_COMMENT, EventStreamResponse, data_frame
from .validation import GenerationSpec, parse_chat, parse_completion


def usage_body(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "colibri"}


async def list_models(request: Request) -> JSONResponse:
    cfg = request.app.state.config
    return JSONResponse({"object": "list", "data": [model_card(cfg.model_id, cfg.created)]})


async def get_model(request: Request) -> JSONResponse:
    cfg = request.app.state.config
    wanted = request.path_params["model_id"]
    if wanted != cfg.model_id:
        raise APIError(404, f"model '{wanted}' not found; this server serves '{cfg.model_id}'", param="model",
                       code="model_not_found")
    return JSONResponse(model_card(cfg.model_id, cfg.created))


def chat_abilities(app: Any) -> dict[str, Any]:
    """What the served model's chat rendering can honour, as the chat-shaped parsers take it."""
    codec = app.state.services.codec
    return {"tools_supported": app.state.tools_supported, "thinking_switch": getattr(codec, "thinking_switch", None),
            "effort_variable": bool(getattr(codec, "reasoning_effort_variable", False))}


async def chat_completions(request: Request):
    app = request.app
    data = await app.state.read_json(request)
    spec = parse_chat(data, app.state.config.model_id, app.state.config.kv_slots, **chat_abilities(app))
    return await _generate(request, spec, chat=True)


async def completions(request: Request):
    app = request.app
    data = await app.state.read_json(request)
    spec = parse_completion(data, app.state.config.model_id, app.state.config.kv_slots)
    return await _generate(request, spec, chat=False)


async def _generate(request: Request, spec: GenerationSpec, chat: bool):
    services = request.app.state.services
    model_id = request.app.state.config.model_id
    run = GenerationRun(services, spec, "chat" if chat else "completions", HangUpWatch(request.receive).start())
    await run.start()   # refusals before this point are plain JSON errors with their status code
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    reply = ReplyParser(run)
    if spec.stream:
        return EventStreamResponse(_stream(run, reply, spec, rid, created, model_id, chat), run.hangup)
    parsed, events, finished = await reply_to_completion(run, reply)
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            call_ids: dict[int, str] = {}
            message["tool_calls"] = [tool_call_body(e, call_ids) for e in events if isinstance(e, ToolCallEvent)]
            message["content"] = parsed.content or None
        choice = {"index": 0, "message": message, "finish_reason": finish_reason(finished, reply), "logprobs": None}
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model_id,
                "choices": [choice], "usage": usage_body(finished.usage)}
    else:
        choice = {"index": 0, "text": parsed.content, "finish_reason": finished.reason, "logprobs": None}
        body = {"id": rid, "object": "text_completion", "created": created, "model": model_id,
                "choices": [choice], "usage": usage_body(finished.usage)}
    return JSONResponse(body)


async def _stream(run: GenerationRun, reply: ReplyParser, spec: GenerationSpec, rid: str, created: int,
                  model_id: str, chat: bool) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    call_ids: dict[int, str] = {}

    def chunk(delta: dict[str, Any] | None, finish: str | None = None) -> bytes:
        if chat:
            choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": (delta or {}).get("content", ""), "finish_reason": finish,
                      "logprobs": None}
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model_id,
                                "choices": [choice]}
        if spec.include_usage:
            body["usage"] = None
        return data_frame(body)

    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        async for item in reply_stream(run, reply):
            if isinstance(item, TextEvent):
                yield chunk({"reasoning_content" if item.channel == REASONING else "content": item.text})
            elif isinstance(item, ToolCallEvent):
                yield chunk({"tool_calls": [tool_call_body(item, call_ids, index=item.index)]})
            elif isinstance(item, KeepAlive):
                yield KEEPALIVE_COMMENT
            elif isinstance(item, Finished):
                yield chunk(None if chat else {}, finish=finish_reason(item, reply) if chat else item.reason)
                if spec.include_usage:
                    yield data_frame({"id": rid, "object": obj, "created": created, "model": model_id,
                                      "choices": [], "usage": usage_body(item.usage)})
                yield DONE
                return
            elif isinstance(item, Failed):
                # after the 200 is committed an error can only travel in-band; the openai client raises on it
                yield data_frame(item.error.openai_body())
                return
    finally:
        run.close()
