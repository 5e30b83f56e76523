"""Noticing that a client hung up, the moment it does, whatever the request is doing meanwhile.

Once a request's body is read, nothing else needs ``receive()``: its next message is ``http.disconnect`` — sent
when the client closes the socket, or when the response is complete. A task of its own waits for that message and
calls the registered callbacks at once, on the event loop's thread. The generation registers its cancel there, so a
hang-up reaches the engine without depending on any other task noticing: not a writer whose ``send`` the server
silently drops after a disconnect, nor a wait that a simultaneous token might make swallow its cancellation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

log = logging.getLogger("colibri.server")


class HangUpWatch:
    """Watches one request's ``receive`` for ``http.disconnect``; start it after the body has been read."""

    def __init__(self, receive: Callable[[], Awaitable[MutableMapping[str, Any]]]):
        self._receive = receive
        self._callbacks: list[Callable[[], None]] = []
        self.gone = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> HangUpWatch:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    def on_hang_up(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (synchronously, on the loop) when the client leaves; at once if it already has."""
        if self.gone.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    @property
    def hung_up(self) -> bool:
        return self.gone.is_set()

    async def wait(self) -> None:
        await self.gone.wait()

    def stop(self) -> None:
        """The request is over (or no longer cares): stop watching."""
        self._callbacks.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _watch(self) -> None:
        try:
            while True:
                message = await self._receive()
                if message.get("type") == "http.disconnect":
                    break
        except Exception as exc:
            log.debug("receive failed while watching for a hang-up: %s", exc)
        self.gone.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("hang-up callback failed")
