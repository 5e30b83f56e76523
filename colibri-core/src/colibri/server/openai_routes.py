"""The OpenAI-compatible routes: chat completions, completions, models."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from .errors import APIError
from ..output_parser import REASONING, TextEvent, ToolCallEvent
from .generation import Failed, Finished, GenerationRun, KeepAlive, Usage
from .hangup import HangUpWatch
from .logprobs import completion_logprobs
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
    if spec.prompt_batch is not None:
        return await _generate_batch(request, spec)
    return await _generate(request, spec, chat=False)


def chat_logprobs(run: GenerationRun, entries: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    if run.spec.logprobs is None:
        return None
    return {"content": run.token_logprobs if entries is None else entries, "refusal": None}


def text_logprobs(run: GenerationRun, entries: list[dict[str, Any]] | None = None,
                  offset0: int = 0) -> dict[str, Any] | None:
    if run.spec.logprobs is None:
        return None
    if entries is None:
        entries = run.prompt_logprobs + run.token_logprobs
    return completion_logprobs(entries, offset0)


async def _generate_batch(request: Request, spec: GenerationSpec):
    """Several prompts in one request: one choice each (index = the prompt's position), run concurrently on the
    server's slots; streamed, each prompt's chunks follow the previous prompt's."""
    specs = [dataclasses.replace(spec, prompt_text=text, prompt_ids=ids, prompt_batch=None)
             for text, ids in spec.prompt_batch or []]
    # one watch reads the request's receive(); each run gets its own view of it (a run's close stops only its own)
    parent = HangUpWatch(request.receive).start()

    async def gone() -> dict[str, Any]:
        await parent.wait()
        return {"type": "http.disconnect"}

    if spec.stream:
        return EventStreamResponse(_stream_batch(request, specs, lambda: HangUpWatch(gone).start()), parent)
    try:
        # every prompt runs to its end even when another is refused, then the first refusal answers the request
        results = await asyncio.gather(*(_complete(request, s, HangUpWatch(gone).start()) for s in specs),
                                       return_exceptions=True)
    finally:
        parent.stop()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    answers = [r for r in results if not isinstance(r, BaseException)]
    choices = []
    for index, (choice, _) in enumerate(answers):
        choices.append({**choice, "index": index})
    usage = Usage(sum(u.prompt_tokens for _, u in answers), sum(u.completion_tokens for _, u in answers),
                  sum(u.cached_tokens for _, u in answers))
    return JSONResponse({"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion",
                         "created": int(time.time()), "model": request.app.state.config.model_id,
                         "choices": choices, "usage": usage_body(usage)})


async def _complete(request: Request, spec: GenerationSpec, watch: HangUpWatch) -> tuple[dict[str, Any], Usage]:
    run = GenerationRun(request.app.state.services, spec, "completions", watch)
    await run.start()
    parsed, _, finished = await reply_to_completion(run, ReplyParser(run))
    return _text_choice(run, parsed.content, finished.reason), finished.usage


def _text_choice(run: GenerationRun, text: str, reason: str | None) -> dict[str, Any]:
    prompt = run.spec.prompt_text if run.spec.prompt_text is not None else run.s.codec.decode(run.prompt_ids)
    echoed = prompt if run.spec.echo else ""
    return {"index": 0, "text": echoed + text, "finish_reason": reason, "logprobs": text_logprobs(run)}


async def _stream_batch(request: Request, specs: list[GenerationSpec], watch: Callable[[], HangUpWatch]
                        ) -> AsyncIterator[bytes]:
    rid, created = "cmpl-" + uuid.uuid4().hex[:24], int(time.time())
    model_id = request.app.state.config.model_id
    for index, spec in enumerate(specs):
        run = GenerationRun(request.app.state.services, spec, "completions", watch())
        try:
            await run.start()
        except APIError as exc:
            yield data_frame(exc.openai_body())
            return
        async for frame in _stream(run, ReplyParser(run), spec, rid, created, model_id, False, index=index,
                                   last=index == len(specs) - 1):
            yield frame


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
        choice = {"index": 0, "message": message, "finish_reason": finish_reason(finished, reply),
                  "logprobs": chat_logprobs(run)}
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model_id,
                "choices": [choice], "usage": usage_body(finished.usage)}
    else:
        choice = _text_choice(run, parsed.content, finished.reason)
        body = {"id": rid, "object": "text_completion", "created": created, "model": model_id,
                "choices": [choice], "usage": usage_body(finished.usage)}
    return JSONResponse(body)


async def _stream(run: GenerationRun, reply: ReplyParser, spec: GenerationSpec, rid: str, created: int,
                  model_id: str, chat: bool, index: int = 0, last: bool = True) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    call_ids: dict[int, str] = {}
    offset = [0]   # completions: text_offset of the next streamed token

    def chunk(delta: dict[str, Any] | None, finish: str | None = None) -> bytes:
        entries = run.take_logprobs()
        if chat:
            choice = {"index": index, "delta": delta or {}, "finish_reason": finish,
                      "logprobs": chat_logprobs(run, entries)}
        else:
            lp = text_logprobs(run, entries, offset[0])
            offset[0] += sum(len(e["token"]) for e in entries)
            choice = {"index": index, "text": (delta or {}).get("content", ""), "finish_reason": finish,
                      "logprobs": lp}
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model_id,
                                "choices": [choice]}
        if spec.include_usage:
            body["usage"] = None
        return data_frame(body)

    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        echo = spec.echo and not chat
        async for item in reply_stream(run, reply):
            if echo and not isinstance(item, KeepAlive):
                # the prompt's rows were all turned into log-probabilities before the first token arrived
                echo = False
                prompt = spec.prompt_text if spec.prompt_text is not None else run.s.codec.decode(run.prompt_ids)
                body = {"index": index, "text": prompt, "finish_reason": None,
                        "logprobs": completion_logprobs(run.prompt_logprobs) if spec.logprobs is not None else None}
                offset[0] = len(prompt)
                yield data_frame({"id": rid, "object": obj, "created": created, "model": model_id,
                                  "choices": [body]})
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
                if last:
                    yield DONE
                return
            elif isinstance(item, Failed):
                # after the 200 is committed an error can only travel in-band; the openai client raises on it
                yield data_frame(item.error.openai_body())
                return
    finally:
        run.close()
