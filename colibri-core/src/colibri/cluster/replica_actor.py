"""One engine replica as a Ray actor: it owns one colibri engine process on the node Ray placed it on.

The actor speaks docs/protocol.md with its engine through :class:`colibri.engine.Engine` (the same client a single
``coli serve`` uses) and hands each request's events back as a Ray streaming generator. It is threaded
(``max_concurrency``), so a cancel, a mask or a status call runs while sequences stream.

When its engine process dies, the actor ends its own worker process: Ray then restarts the actor (``max_restarts``),
which starts a fresh engine. The requests that were running get a ``died`` event first (or, if the actor was faster,
Ray's actor-died error); the server turns both into a clean 503 for those requests only.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Iterator

from ..engine import Engine, EngineRequestError, Request
from ..errors import ColibriError, EngineError
from ..launch import LaunchSpec, start

WATCH_INTERVAL_S = 0.2
# After its engine died the actor lives this long so the running requests' generators deliver their ``died`` event.
DEATH_GRACE_S = 0.5
HIT_RATES_KEPT = 64
DIED = "replica_died"   # the event a request gets when the replica's engine died under it
# the event a request gets when it came after the engine died (before Ray replaced the actor): submit it again
RESTARTING = "replica_restarting"


class ReplicaActor:
    """The actor's class (made remote by :func:`colibri.cluster.replicas.replica_class`)."""

    def __init__(self, spec: LaunchSpec, index: int):
        import ray

        self.index = index
        self.started_at = time.time()
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.reconstructed = bool(context.was_current_actor_reconstructed)
        self.engine: Engine = start(spec)
        self.slots = spec.slots
        self._lock = threading.Lock()
        self._running: dict[int, Request] = {}
        self._cancelled: set[int] = set()   # cancels that came before their request's submit
        self._highest_rid = 0                # ids come in order from the pool: one at most this high has begun
        self.served = 0
        self.failed = 0
        self.hit_rates: collections.deque[float] = collections.deque(maxlen=HIT_RATES_KEPT)
        self.closing = False
        threading.Thread(target=self._watch, name="replica-watch", daemon=True).start()

    # ---- requests -------------------------------------------------------------------------------------------

    def generate(self, rid: int, prompt: list[int], slot: int, options: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Submit one sequence and yield its events until ``done``; ``error`` ends it as the engine sent it, an
        engine death as a :data:`DIED` event."""
        try:
            request = self.engine.submit(prompt, slot=slot, **options)
        except EngineError:   # the engine is already gone: this request never reached it
            yield {"ev": RESTARTING}
            return
        with self._lock:
            self._running[rid] = request
            self._highest_rid = max(self._highest_rid, rid)
            early_cancel = rid in self._cancelled
            self._cancelled.discard(rid)
        if early_cancel:
            request.cancel()
        try:
            for event in request:
                if event.get("ev") == "done":
                    self._count_done(event)
                yield event
        except EngineRequestError as exc:
            yield {"ev": "error", "code": exc.code, "message": exc.message.split(": ", 1)[-1]}
        except EngineError as exc:
            with self._lock:
                self.failed += 1
            yield {"ev": DIED, "message": exc.one_line()}
        finally:
            with self._lock:
                self._running.pop(rid, None)

    def _count_done(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.served += 1
            if isinstance(event.get("hit_rate"), (int, float)):
                self.hit_rates.append(float(event["hit_rate"]))

    def _request(self, rid: int) -> Request | None:
        with self._lock:
            return self._running.get(rid)

    def cancel(self, rid: int) -> None:
        with self._lock:
            request = self._running.get(rid)
            if request is None and rid > self._highest_rid:   # not begun yet (a lower id not running has ended)
                self._cancelled.add(rid)
        if request is not None:
            request.cancel()

    def mask(self, rid: int, allow: bytes) -> None:
        request = self._request(rid)
        if request is not None:
            self.engine.mask(request, allow)

    def reset(self, slot: int) -> None:
        self.engine.reset(slot)

    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        return self.engine.stats(timeout=timeout)

    # ---- what the server and `coli cluster status` ask ------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "node_id": self.node_id, "node_ip": self.node_ip,
                "engine_pid": self.engine.proc.pid, "engine_alive": self.engine.alive, "ready": dict(self.engine.ready),
                "reconstructed": self.reconstructed, "started_at": self.started_at, "slots": self.slots}

    def load(self) -> dict[str, Any]:
        """Slots busy and requests served or failed since this replica started (no engine round trip)."""
        with self._lock:
            return {"slots_busy": len(self._running), "served": self.served, "failed": self.failed}

    def status(self) -> dict[str, Any]:
        """Node (and its RAM), state, slots busy, requests served and per-request hit rates (with the engine's own
        totals)."""
        from .status import node_memory

        with self._lock:
            rates = list(self.hit_rates)
        row = {**self.info(), **self.load(), "state": "ready" if self.engine.alive else "restarting",
               "last_hit_rate": rates[-1] if rates else None,
               "mean_hit_rate": sum(rates) / len(rates) if rates else None, "node_ram": node_memory()}
        try:
            totals = self.engine.stats(timeout=5.0)
        except ColibriError:
            totals = {}
        row.update(engine_hit_rate=totals.get("hit_rate"), rss_bytes=totals.get("rss_bytes"),
                   expert_bytes_read=totals.get("expert_bytes_read"))
        return row

    def close(self) -> None:
        self.closing = True
        self.engine.close()

    # ---- health ---------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while self.engine.alive:
            time.sleep(WATCH_INTERVAL_S)
        if self.closing:   # closed on purpose (the server shuts down): nothing to restart
            return
        time.sleep(DEATH_GRACE_S)
        # A failure exit, not ray.actor.exit_actor(): Ray restarts an actor whose process died, not one that quit.
        os._exit(1)
