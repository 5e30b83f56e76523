"""Server-sent events: framing, and a response that notices a client hang-up even while nothing is sent.

Starlette's ``StreamingResponse`` on ASGI 2.4 servers learns of a disconnect only when a write fails, which
during a long prefill may be minutes away; this response listens for ``http.disconnect`` alongside the stream and
cancels it at once, so the generation's ``finally`` cancels the sequence in the engine and the slot frees.
A broken connection is a normal hang-up, never an error in the log.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

KEEPALIVE_COMMENT = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),     # proxies (nginx) must not buffer the stream
]


def data_frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def event_frame(name: str, payload: dict[str, Any]) -> bytes:
    return (b"event: " + name.encode() + b"\n" + data_frame(payload))


class EventStreamResponse:
    """An ASGI response that sends ``frames`` as an SSE body and cancels it when the client disconnects."""

    def __init__(self, frames: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]] | None = None):
        self.frames = frames
        self.headers = SSE_HEADERS + list(headers or [])

    async def __call__(self, scope, receive, send) -> None:
        writer = asyncio.ensure_future(self._write(send))
        listener = asyncio.ensure_future(self._listen(receive))
        try:
            await asyncio.wait({writer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, listener):
                task.cancel()
            for task in (writer, listener):
                try:
                    await task
                except (asyncio.CancelledError, OSError):
                    pass
            await _close(self.frames)

    async def _write(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        async for frame in self.frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _listen(receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return


async def _close(frames: AsyncIterator[bytes]) -> None:
    aclose = getattr(frames, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except (RuntimeError, asyncio.CancelledError):
            pass
