"""The Responses API route (``POST /v1/responses``): one reply as output items (``reasoning``, ``message``,
``function_call``), streamed as its typed events.

The reply is split by the same family parser as the chat route's (:mod:`.replies`). A stream opens one output
item per change of kind, in the order the model wrote them; each item gets its ``added`` event, its deltas, its
``done`` events, then the next one starts, and ``response.completed`` (``response.incomplete`` at the token
limit) carries the whole response, as OpenAI's service sends it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..output_parser import REASONING, TextEvent, ToolCallEvent
from .generation import Failed, Finished, GenerationRun
from .hangup import HangUpWatch
from .openai_routes import chat_abilities
from .replies import ReplyParser, call_id, formatted_stream, reply_to_completion
from .responses_fields import parse_responses
from .sse import KEEPALIVE_COMMENT, EventStreamResponse, event_frame
from .validation import GenerationSpec


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class _Response:
    """The response object of one request, as each event and the final body show it."""

    def __init__(self, data: dict[str, Any], spec: GenerationSpec, model_id: str, run: GenerationRun):
        self.id = _new_id("resp_")
        self.created = int(time.time())
        self.data, self.spec, self.model_id, self.run = data, spec, model_id, run

    def body(self, status: str, output: list[dict[str, Any]], finished: Finished | None = None,
             reasoning_text: str = "") -> dict[str, Any]:
        asked = self.data.get("reasoning")
        reasoning: dict[str, Any] = asked if isinstance(asked, dict) else {}
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model_id, "output": output, "error": None, "incomplete_details": None,
            "instructions": self.data.get("instructions"), "metadata": self.data.get("metadata") or {},
            "parallel_tool_calls": self.spec.parallel_tool_calls, "tool_choice": self.spec.tool_choice,
            "tools": self.data.get("tools") or [], "temperature": self.spec.temperature, "top_p": self.spec.top_p,
            "max_output_tokens": self.spec.max_tokens, "previous_response_id": None, "store": False,
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "reasoning": {"effort": reasoning.get("effort"), "summary": None}, "user": self.spec.user,
            "usage": None,
        }
        if finished is not None:
            u = finished.usage
            if finished.reason == "length":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            # reasoning tokens: the reasoning text re-tokenized (the engine does not label its tokens)
            thought = len(self.run.s.codec.encode(reasoning_text, add_special_tokens=False)) if reasoning_text else 0
            body["usage"] = {"input_tokens": u.prompt_tokens,
                             "input_tokens_details": {"cached_tokens": u.cached_tokens},
                             "output_tokens": u.completion_tokens,
                             "output_tokens_details": {"reasoning_tokens": min(thought, u.completion_tokens)},
                             "total_tokens": u.total_tokens}
        return body


def _status(finished: Finished) -> str:
    return "incomplete" if finished.reason == "length" else "completed"


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(event: ToolCallEvent, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": _new_id("fc_"), "call_id": call_id(event, "call_"),
            "name": event.call.name, "arguments": event.call.arguments if status == "completed" else "",
            "status": status}


async def responses(request: Request):
    app = request.app
    data = await app.state.read_json(request)
    spec = parse_responses(data, app.state.config.model_id, app.state.config.kv_slots, **chat_abilities(app))
    run = GenerationRun(app.state.services, spec, "chat", HangUpWatch(request.receive).start())
    await run.start()   # refusals before this point are plain JSON errors with their status code
    response = _Response(data, spec, app.state.config.model_id, run)
    reply = ReplyParser(run)
    if spec.stream:
        return EventStreamResponse(_stream(run, reply, response), run.hangup)
    parsed, events, finished = await reply_to_completion(run, reply)
    output: list[dict[str, Any]] = []
    if parsed.reasoning:
        output.append(_reasoning_item(_new_id("rs_"), parsed.reasoning, "completed"))
    if parsed.content or not parsed.tool_calls:
        output.append(_message_item(_new_id("msg_"), parsed.content, "completed"))
    output += [_call_item(e, "completed") for e in events if isinstance(e, ToolCallEvent)]
    return JSONResponse(response.body(_status(finished), output, finished, parsed.reasoning))


class _Items:
    """The output items of a streamed response and the events that open, fill and close them."""

    def __init__(self, response: _Response):
        self.response = response
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None      # the item being written (a reasoning or message item)
        self.written = ""                            # its text so far
        self.reasoning = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        frame = event_frame(kind, {"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return frame

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def text(self, event: TextEvent) -> list[bytes]:
        kind = "reasoning" if event.channel == REASONING else "message"
        frames = [] if self.open is not None and self.open["type"] == kind else self.close() + self._start(kind)
        self.written += event.text
        if kind == "reasoning":
            self.reasoning += event.text
            frames.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                     delta=event.text))
        else:
            frames.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                     delta=event.text, logprobs=[]))
        return frames

    def _start(self, kind: str) -> list[bytes]:
        if kind == "reasoning":
            self.open = _reasoning_item(_new_id("rs_"), "", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            self.open = _message_item(_new_id("msg_"), "", "in_progress")
            part = _text_part("")
        self.written = ""
        return [self.event("response.output_item.added", output_index=len(self.output), item=self.open),
                self.event("response.content_part.added", **self._where(), content_index=0, part=part)]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        where, text = self._where(), self.written
        if self.open["type"] == "reasoning":
            item = _reasoning_item(self.open["id"], text, "completed")
            frames = [self.event("response.reasoning_text.done", **where, content_index=0, text=text)]
        else:
            item = _message_item(self.open["id"], text, "completed")
            frames = [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])]
        frames += [self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]),
                   self.event("response.output_item.done", output_index=where["output_index"], item=item)]
        self.output.append(item)
        self.open = None
        return frames

    def call(self, event: ToolCallEvent) -> list[bytes]:
        frames = self.close()
        item = _call_item(event, "completed")
        where = {"item_id": item["id"], "output_index": len(self.output)}
        frames += [
            self.event("response.output_item.added", output_index=where["output_index"],
                       item={**item, "arguments": "", "status": "in_progress"}),
            self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self.event("response.function_call_arguments.done", **where, name=item["name"],
                       arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=where["output_index"], item=item)]
        self.output.append(item)
        return frames

    def finished(self, item: Finished) -> list[bytes]:
        if self.open is None and not self.output:   # an empty reply is still one (empty) message
            frames = self._start("message") + self.close()
        else:
            frames = self.close()
        status = _status(item)
        return frames + [self.event(f"response.{status}", response=self.response.body(
            status, self.output, item, self.reasoning))]

    def failed(self, item: Failed) -> list[bytes]:
        # after the 200 is committed an error can only travel in-band
        error = item.error
        failed = self.response.body("failed", self.output)
        failed["error"] = {"code": "server_error", "message": error.message}
        return [self.event("error", code=error.code, message=error.message, param=error.param),
                self.event("response.failed", response=failed)]


def _stream(run: GenerationRun, reply: ReplyParser, response: _Response) -> AsyncIterator[bytes]:
    items = _Items(response)
    opening = [items.event(kind, response=response.body("in_progress", []))
               for kind in ("response.created", "response.in_progress")]
    return formatted_stream(run, reply, items, opening, keepalive=lambda: KEEPALIVE_COMMENT)
