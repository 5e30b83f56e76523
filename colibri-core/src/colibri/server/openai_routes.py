"""The OpenAI-compatible routes: chat completions, completions, models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from .errors import APIError
from .generation import (
    Delta,
    Failed,
    Finished,
    GenerationRun,
    KeepAlive,
    Usage,
    run_to_completion,
)
from .hangup import HangUpWatch
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


async def chat_completions(request: Request):
    app = request.app
    data = await app.state.read_json(request)
    spec = parse_chat(data, app.state.config.model_id, app.state.config.kv_slots,
                      tools_supported=app.state.tools_supported)
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
    if spec.stream:
        return EventStreamResponse(_stream(run, spec, rid, created, model_id, chat), run.hangup)
    text, finished = await run_to_completion(run)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                  "finish_reason": finished.reason, "logprobs": None}
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model_id,
                "choices": [choice], "usage": usage_body(finished.usage)}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finished.reason, "logprobs": None}
        body = {"id": rid, "object": "text_completion", "created": created, "model": model_id,
                "choices": [choice], "usage": usage_body(finished.usage)}
    return JSONResponse(body)


async def _stream(run: GenerationRun, spec: GenerationSpec, rid: str, created: int, model_id: str,
                  chat: bool) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(content: str | None, finish: str | None = None, first: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": content or "", "finish_reason": finish, "logprobs": None}
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model_id,
                                "choices": [choice]}
        if spec.include_usage:
            body["usage"] = None
        return data_frame(body)

    try:
        if chat:
            yield chunk("", first=True)
        async for item in run.stream():
            if isinstance(item, Delta):
                yield chunk(item.text)
            elif isinstance(item, KeepAlive):
                yield KEEPALIVE_COMMENT
            elif isinstance(item, Finished):
                yield chunk(None if chat else "", finish=item.reason)
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
