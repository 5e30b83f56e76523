"""Server-sent events: framing, and a response that stops the moment its client hangs up.

Starlette's ``StreamingResponse`` on ASGI 2.4 servers learns of a disconnect only when a write fails, which
during a long prefill may be minutes away — and uvicorn's ``send`` after a disconnect is a silent no-op, so it
may never learn. This response waits on the request's :class:`~.hangup.HangUpWatch` alongside the stream (the
watch has already cancelled the sequence in the engine by then) and cancels the writer, whose ``finally`` closes
the generation. A broken connection is a normal hang-up, never an error in the log.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from .hangup import HangUpWatch

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
    """An ASGI response that sends ``frames`` as an SSE body and cancels it when the client hangs up."""

    def __init__(self, frames: AsyncIterator[bytes], hangup: HangUpWatch,
                 headers: list[tuple[bytes, bytes]] | None = None):
        self.frames = frames
        self.hangup = hangup
        self.headers = SSE_HEADERS + list(headers or [])

    async def __call__(self, scope, receive, send) -> None:
        writer = asyncio.ensure_future(self._write(send))
        gone = asyncio.ensure_future(self.hangup.wait())
        try:
            await asyncio.wait({writer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, gone):
                task.cancel()
            for task in (writer, gone):
                try:
                    await task
                except (asyncio.CancelledError, OSError):
                    pass
            await _close(self.frames)
            self.hangup.stop()

    async def _write(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        async for frame in self.frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _close(frames: AsyncIterator[bytes]) -> None:
    aclose = getattr(frames, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except (RuntimeError, asyncio.CancelledError):
            pass
