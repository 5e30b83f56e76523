"""Keeping one engine process alive behind the server: load, watch, restart.

The engine is a separate process so a crash takes only it. When it dies, every in-flight request fails (its
engine iterator raises), ``/health`` turns 503, and the host starts a fresh engine with backoff; requests that
arrive meanwhile wait for it (bounded by the queue timeout) instead of failing. A first load that fails is
fatal for the server: the model will not load on a second try either, and a person should see why at once.

An engine that says ``self_healing`` (the cluster's replica pool, colibri.cluster.replicas) restarts its own parts:
a request that saw one replica die fails alone, and the host keeps the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import ColibriError
from .errors import APIError

log = logging.getLogger("colibri.server")

RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)
WATCH_INTERVAL_S = 0.2


class EngineLike(Protocol):
    ready: dict[str, Any]

    @property
    def alive(self) -> bool: ...

    @property
    def submit(self) -> Callable[..., Any]: ...   # (prompt, **sampling) -> a request; Engine.submit names its keywords

    def close(self) -> None: ...


class FamilyHost:
    """The host of a server whose routes are a family's own (``server_routes``): no text engine to keep alive,
    the family starts its engine per request, so the server is ready at once."""

    ready = True
    state = "ready"
    detail = ""
    restarts = 0

    def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


class EngineHost:
    """Owns the current engine; every access goes through :meth:`engine` so a restart is seen everywhere."""

    def __init__(self, factory: Callable[[], EngineLike], on_fatal: Callable[[str], None] | None = None):
        self._factory = factory
        self._on_fatal = on_fatal
        self._engine: EngineLike | None = None
        self._ready = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.state = "loading"        # loading | ready | restarting | failed | stopped
        self.detail = ""              # why the engine is not ready (the last death or load error)
        self.restarts = 0
        self.loaded_once = False
        self.engine_info: dict[str, Any] = {}
        self._failures = 0
        self._restart_task: asyncio.Task | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin loading in the background (the server answers /health with 503 meanwhile)."""
        self._spawn(self._load())
        self._spawn(self._watch())

    async def close(self) -> None:
        self.state = "stopped"
        self._ready.clear()
        for task in list(self._tasks):
            task.cancel()
        engine, self._engine = self._engine, None
        if engine is not None:
            await asyncio.to_thread(engine.close)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _load(self) -> None:
        while self.state in ("loading", "restarting"):
            delay = RESTART_BACKOFF_S[min(self._failures, len(RESTART_BACKOFF_S) - 1)] if self.loaded_once else 0
            if delay:
                await asyncio.sleep(delay)
            started = time.monotonic()
            try:
                engine = await asyncio.to_thread(self._factory)
            except ColibriError as exc:
                self.detail = exc.one_line()
            except Exception as exc:
                self.detail = f"engine failed to start: {exc}"
            else:
                if self.state == "stopped":
                    await asyncio.to_thread(engine.close)
                    return
                self._engine = engine
                self.engine_info = dict(getattr(engine, "ready", {}) or {})
                self.state = "ready"
                self.detail = ""
                self._failures = 0
                self.loaded_once = True
                self._ready.set()
                log.info("engine ready in %.1f s", time.monotonic() - started)
                return
            self._failures += 1
            if not self.loaded_once:
                self.state = "failed"
                log.error("engine failed to load: %s", self.detail)
                if self._on_fatal:
                    self._on_fatal(self.detail)
                return
            log.error("engine restart failed: %s", self.detail)

    async def _watch(self) -> None:
        """Notice a death even when no request is running (kill -9 of an idle engine)."""
        while self.state != "stopped":
            await asyncio.sleep(WATCH_INTERVAL_S)
            engine = self._engine
            if engine is not None and self.state == "ready" and not engine.alive:
                self.report_death(engine, await asyncio.to_thread(_death_reason, engine))

    def report_death(self, engine: EngineLike, error: BaseException | None) -> None:
        """Called (on the loop) when a request saw the engine die, or the watcher did."""
        if engine is not self._engine or self.state != "ready":
            return
        if getattr(engine, "self_healing", False) and engine.alive:
            # a replica pool: one replica died and Ray restarts it; the others go on serving
            log.warning("a replica failed a request: %s", error.one_line() if isinstance(error, ColibriError)
                        else error)
            return
        self.state = "restarting"
        self._ready.clear()
        self.detail = error.one_line() if isinstance(error, ColibriError) else (str(error) if error else
                                                                                  "engine process exited")
        log.error("engine died: %s; restarting", self.detail)
        self.restarts += 1
        self._engine = None
        self._spawn(self._retire(engine))
        self._spawn(self._load())

    async def _retire(self, engine: EngineLike) -> None:
        try:
            await asyncio.to_thread(engine.close)
        except Exception as exc:
            log.debug("closing the dead engine failed: %s", exc)

    # ---- access -----------------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def engine(self, timeout: float) -> EngineLike:
        """The live engine, waiting up to ``timeout`` s while one loads; 503 otherwise."""
        if self.state in ("failed", "stopped"):
            raise APIError(503, f"engine unavailable: {self.detail or self.state}", code="engine_unavailable",
                           headers={"Retry-After": "5"})
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), timeout=timeout)
            except asyncio.TimeoutError:
                raise APIError(503, f"engine is {self.state}: {self.detail or 'loading the model'}; retry shortly",
                               code="engine_unavailable", headers={"Retry-After": "5"}) from None
        engine = self._engine
        if engine is None:
            raise APIError(503, "engine is restarting; retry shortly", code="engine_unavailable",
                           headers={"Retry-After": "2"})
        return engine


def _death_reason(engine: EngineLike, wait_s: float = 1.0) -> BaseException | None:
    """The engine client's own account of a death (signal, exit code, stderr tail), once its reader has it."""
    deadline = time.monotonic() + wait_s
    while True:
        reason = getattr(engine, "death", None) or getattr(engine, "_dead", None)
        if reason is not None or time.monotonic() > deadline:
            return reason
        time.sleep(0.02)
