"""Connection-level defences against slow and idle clients: a header deadline, connection caps, and one log line
(not a flood) when the process runs out of file descriptors.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) but has no deadline for a request's
headers: a client that sends them a byte at a time, or connects and sends nothing, holds its socket forever, and a
few hundred such sockets exhaust the descriptors. Its ``limit_concurrency`` answers 503 only once a request's
headers are in, and knows nothing of client addresses. So the HTTP protocol uvicorn would use is extended here:

- **header deadline**: from the moment a connection opens, or its previous response completes, the next request's
  headers must be complete within ``header_timeout`` seconds, else the connection is closed (with a 408 if part of
  a request had arrived);
- **connection caps**: at most ``max_connections`` open connections, and ``max_connections_per_client`` from one
  client address; one more is answered 503 with ``Retry-After`` and closed at once;
- **descriptor exhaustion**: asyncio reports every failed ``accept()`` (EMFILE/ENFILE) with a traceback; these are
  folded into one warning per :data:`FD_LOG_INTERVAL_S` that says how many there were and what to change.

The body's deadline is the app's (``read_limited_body``): it is the one reading the body.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import resource
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("colibri.server")

FD_LOG_INTERVAL_S = 30.0
REFUSAL_LOG_INTERVAL_S = 30.0
FD_RESERVE = 64            # descriptors kept for the engine's pipes, model files and logs
DEFAULT_MAX_CONNECTIONS = 512
_FD_ERRNOS = (errno.EMFILE, errno.ENFILE)


def default_max_connections() -> int:
    """512, or fewer when the descriptor limit would not hold that many (each connection is one descriptor)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 32
    return max(8, min(DEFAULT_MAX_CONNECTIONS, soft - in_use - FD_RESERVE))


class RateLimitedLog:
    """Counts occurrences; logs the first, then at most one summary line per interval."""

    def __init__(self, interval_s: float, emit: Callable[[int], None], clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.emit = emit
        self.clock = clock
        self._last = -float("inf")
        self._pending = 0

    def hit(self) -> None:
        self._pending += 1
        now = self.clock()
        if now - self._last >= self.interval_s:
            count, self._pending, self._last = self._pending, 0, now
            self.emit(count)


class ConnectionGuard:
    """Counts open connections, in total and per client address."""

    def __init__(self, max_connections: int, max_per_client: int, header_timeout: float):
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.header_timeout = header_timeout
        self.open = 0
        self.per_client: collections.Counter[str] = collections.Counter()
        self._refusals = RateLimitedLog(REFUSAL_LOG_INTERVAL_S, self._log_refusals)

    def admit(self, client: str) -> bool:
        if self.open >= self.max_connections or self.per_client[client] >= self.max_per_client:
            self._refusals.hit()
            return False
        self.open += 1
        self.per_client[client] += 1
        return True

    def release(self, client: str) -> None:
        self.open -= 1
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]

    def _log_refusals(self, count: int) -> None:
        log.warning("refused %d connection(s): %d open (--max-connections %d, --max-connections-per-client %d)",
                    count, self.open, self.max_connections, self.max_per_client)


_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_REFUSED_BODY = (b'{"error": {"message": "too many open connections; retry shortly", "type": "server_error", '
                 b'"param": null, "code": "too_many_connections"}}')
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
              b"content-length: %d\r\n\r\n%s")
_TIMED_OUT_BODY = (b'{"error": {"message": "the request headers did not arrive in time (--header-timeout)", '
                   b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}')


def guarded_protocol(base: type[asyncio.Protocol], guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """``base`` (uvicorn's HTTP/1.1 protocol: it has ``cycle``, ``transport`` and ``on_response_complete``) with
    the guard's caps and header deadline."""

    class GuardedHTTPProtocol(base):  # type: ignore[misc, valid-type]
        _admitted = False
        _client = ""
        _deadline: asyncio.TimerHandle | None = None
        _idle_cycle: Any = None      # the cycle that was current when the deadline was armed
        _partial = False             # bytes of the next request arrived since then

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self._client = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "unix"
            if not guard.admit(self._client):
                transport.write(_REFUSED % (len(_REFUSED_BODY), _REFUSED_BODY))
                transport.close()
                return
            self._admitted = True
            self._arm()

        def data_received(self, data: bytes) -> None:
            if not self._admitted:
                return
            if self._deadline is not None:
                self._partial = True
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._idle_cycle:
                self._disarm()   # the headers are in: from here the app's body deadline and the response rule

        def on_response_complete(self) -> None:
            finished = self.cycle
            super().on_response_complete()
            # a pipelined request may have started inside; if not, the next one's headers have a deadline too
            if self.cycle is finished and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._admitted:
                self._admitted = False
                guard.release(self._client)
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._idle_cycle = self.cycle
            self._partial = False
            self._deadline = asyncio.get_running_loop().call_later(guard.header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.cycle is not self._idle_cycle or self.transport.is_closing():
                return
            if self._partial:
                self.transport.write(_TIMED_OUT % (len(_TIMED_OUT_BODY), _TIMED_OUT_BODY))
            self.transport.close()

    GuardedHTTPProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedHTTPProtocol


def install_fd_exhaustion_log(loop: asyncio.AbstractEventLoop) -> None:
    """Fold asyncio's per-``accept()`` reports of descriptor exhaustion into one line per interval."""
    previous = loop.get_exception_handler()

    def report(count: int) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.warning("out of file descriptors (limit %s): %d connection(s) could not be accepted; raise the limit "
                    "(ulimit -n) or lower --max-connections", soft, count)

    limited = RateLimitedLog(FD_LOG_INTERVAL_S, report)

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _FD_ERRNOS:
            limited.hit()
        elif isinstance(exc, ValueError) and "_start_serving" in str(context.get("message", "")):
            # after a failed accept() asyncio retries in a second; a retry still pending when the server closes
            # its socket fails on the closed descriptor: harmless, part of shutting down
            log.debug("accept retry after shutdown: %s", exc)
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def uvicorn_server(app: Any, config: Any, **options: Any):
    """A uvicorn server for ``app`` whose HTTP protocol is guarded as ``config`` (a ServerConfig) says."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    guard = ConnectionGuard(config.max_connections or default_max_connections(), config.max_connections_per_client,
                            config.header_timeout)
    return uvicorn.Server(uvicorn.Config(app, http=guarded_protocol(AutoHTTPProtocol, guard), **options))
