"""One info line per HTTP request (method, path, route, status, tokens, duration) and its duration histogram.

An outermost ASGI middleware, so refusals by the key gate or the body limit are logged too, and a streamed
response is timed to its last byte. What only the inside knows (which route answered, how many tokens) reaches it
through :func:`note`, which fills the current request's record (a context variable: the route handler, the
tokenizer thread and the streaming loop all run in the request's context).
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from typing import Any

from .metrics import Metrics

log = logging.getLogger("colibri.server.access")
_record: ContextVar[dict[str, Any] | None] = ContextVar("colibri_request_record", default=None)
UNROUTED = "none"   # the route label of a request answered before routing (key gate, 404, preflight)


def note(**fields: Any) -> None:
    """Add ``fields`` (``route``, ``prompt_tokens``, ``completion_tokens``) to the current request's record."""
    record = _record.get()
    if record is not None:
        record.update(fields)


def describe(method: str, path: str, record: dict[str, Any], seconds: float) -> str:
    """The log line, e.g. ``POST /v1/chat/completions chat 200 tokens=12+32 0.412s``."""
    prompt, completion = record.get("prompt_tokens"), record.get("completion_tokens")
    tokens = "-" if prompt is None else f"{prompt}+{completion or 0}"
    return (f"{method} {path} {record.get('route', UNROUTED)} {record.get('status', 0)} tokens={tokens} "
            f"{seconds:.3f}s")


class AccessLog:
    """ASGI middleware: log each HTTP request once it is answered, and observe its duration by route."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record: dict[str, Any] = {}
        token = _record.set(record)
        started = time.monotonic()

        async def recording_send(message):
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            _record.reset(token)
            seconds = time.monotonic() - started
            self.metrics.observe_request(record.get("route", UNROUTED), seconds)
            log.info("%s", describe(scope["method"], scope["path"], record, seconds))
