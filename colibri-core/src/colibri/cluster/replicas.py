"""Replicas mode: N engine replicas as Ray actors behind the one ``coli serve`` endpoint (docs/cluster.md).

:class:`ReplicaPool` is the server's engine: the server keeps its one scheduler, and its KV slots are spread over
the replicas, global slot ``g`` being local slot ``g // N`` of replica ``g % N`` (new conversations go to the
replicas in turn). The scheduler's conversation affinity (a conversation's key sticks to the slot that served it
last) therefore sends a follow-up turn to the replica whose engine holds its prefix.

A replica whose engine dies is restarted by Ray; the requests it was running end with a :class:`ReplicaDied`
(the server answers 503 for them), the other replicas carry on, and the pool itself stays up: it tells the
server's engine host so with ``self_healing``.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, cast

from ..engine import DEFAULT_READY_TIMEOUT, Death, Request
from ..errors import ColibriError, EngineError, UsageError
from ..launch import LaunchSpec
from . import NAMESPACE, require_ray
from .replica_actor import DIED, RESTARTING, ReplicaActor

ACTOR_PREFIX = "replica-"           # then "<server group>-<index>": `coli cluster status` lists these
CALL_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
REPLACEMENT_POLL_S = 0.1
# A tag only pins; a replica takes this sliver of it, so any number of replicas fit on a node with the tag.
TAG_SHARE = 0.001
# Engine counters that add up across replicas (the rest, e.g. per-layer expert counts, are the same on each).
SUMMED_STATS = ("expert_hits", "expert_misses", "expert_bytes_read", "expert_reads", "prefilled_tokens",
                "generated_tokens", "rss_bytes", "hits", "misses", "bytes_read", "reads", "uses")

log = logging.getLogger("colibri.cluster")


class ReplicaDied(EngineError):
    """A request's replica died under it (its engine, its actor or its node)."""


def connect(address: str | None) -> ModuleType:
    """Join the Ray cluster at ``address`` (``auto``: the one this machine runs; None: ``RAY_ADDRESS`` or else a new
    local one), once per process; the ``ray`` module."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    options: dict[str, Any] = {"namespace": NAMESPACE, "logging_level": logging.WARNING, "log_to_driver": False}
    if address is None and not os.environ.get("RAY_ADDRESS"):
        options["include_dashboard"] = False   # a local cluster of our own: nothing else needs its dashboard
    try:
        _check_reachable(address)
        ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--address {address or 'auto'}: cannot join the Ray cluster ({first})",
                         "start one with `ray start --head`, or pass the head's address (host:6379)") from None
    return ray


def _check_reachable(address: str | None) -> None:
    """Raise ConnectionError at once when nothing listens at the cluster's address: ray.init would retry for
    minutes. (The address as Ray resolves it: ``auto`` is the cluster this machine last started or runs.)"""
    from ray._private.services import canonicalize_bootstrap_address   # Ray's own reading of the address

    resolved = canonicalize_bootstrap_address(address)
    if resolved is None:
        return   # a new local cluster
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {resolved}: {exc.strerror or exc}") from None


def alive_nodes(ray: ModuleType) -> list[dict[str, Any]]:
    return [node for node in ray.nodes() if node.get("Alive")]


def check_placement(ray: ModuleType, resources: Sequence[str], cpus: int) -> None:
    """Refuse at once what Ray would otherwise leave pending forever: a tag no node has, more CPUs than any has."""
    nodes = alive_nodes(ray)
    for tag in resources:
        if not any(tag in node.get("Resources", {}) for node in nodes):
            raise UsageError(f"--replica-resource {tag}: no node of the Ray cluster has this resource",
                             f"start a node with `ray start --resources '{{\"{tag}\": 1}}'`; "
                             "coli cluster status lists each node's resources")
    most = max((node.get("Resources", {}).get("CPU", 0) for node in nodes), default=0)
    if cpus > most:
        raise UsageError(f"--threads {cpus}: no node of the Ray cluster has that many CPUs (the most is {most:g})",
                         "pass a smaller --threads")


_REMOTE: dict[int, Any] = {}


def replica_class(ray: ModuleType) -> Any:
    """:class:`ReplicaActor` as a Ray actor class (made once per process)."""
    if id(ray) not in _REMOTE:
        _REMOTE[id(ray)] = ray.remote(ReplicaActor)
    return _REMOTE[id(ray)]


def merge_stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' ``stats`` answers as one: counters added up (per layer too), hit rate recomputed."""
    merged = dict(rows[0])
    for row in rows[1:]:
        for key in SUMMED_STATS:
            if key in merged and key in row:
                merged[key] = _added(merged[key], row[key])
    hits, misses = merged.get("expert_hits"), merged.get("expert_misses")
    if isinstance(hits, (int, float)) and isinstance(misses, (int, float)):
        merged["hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
    merged["replicas"] = len(rows)
    return merged


def _added(a: Any, b: Any) -> Any:
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [_added(x, y) for x, y in zip(a, b)]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return a + b
    return a


class ReplicaRequest(Request):
    """One sequence on one replica: the engine client's :class:`Request`, fed from the actor's event stream."""

    def __init__(self, pool: ReplicaPool, rid: int, slot: int, replica: int, submit: Callable[[], Any]):
        super().__init__(cast(Any, pool), rid, slot)
        self.pool = pool
        self.replica = replica
        self._submit = submit
        self._stream = submit()

    def _next_item(self, timeout: float | None) -> dict[str, Any] | Death:
        ray = self.pool.ray
        try:
            event = ray.get(next(self._stream))
            if event.get("ev") == RESTARTING:   # it came between the engine's death and Ray's replacement
                self.pool.await_replacement(self.replica)
                self._stream = self._submit()
                event = ray.get(next(self._stream))
        except StopIteration:
            return Death(ReplicaDied(f"{self.pool.describe(self.replica)} ended request {self.id} without its done"))
        except ray.exceptions.RayError as exc:
            return Death(self.pool.lost(self.replica, exc))
        except ReplicaDied as exc:
            return Death(exc)
        if event.get("ev") in (DIED, RESTARTING):
            return Death(ReplicaDied(f"{self.pool.describe(self.replica)}: {event.get('message', 'engine died')}"))
        return event

    def cancel(self) -> None:
        if not self.finished:
            self.pool.actors[self.replica].cancel.remote(self.id)


class ReplicaPool:
    """N replicas on the Ray cluster, as one engine to the server (``EngineLike``)."""

    self_healing = True   # Ray restarts a dead replica; the server's engine host must not restart the pool

    def __init__(self, spec: LaunchSpec, replicas: int, *, address: str | None = None,
                 resources: Sequence[str] = (), max_restarts: int = -1,
                 ready_timeout: float = DEFAULT_READY_TIMEOUT):
        if replicas < 1:
            raise UsageError(f"--replicas {replicas}: must be at least 1")
        self.ray = connect(address)
        check_placement(self.ray, resources, spec.threads)
        self.group = secrets.token_hex(3)
        self.slots_per_replica = spec.slots
        self._ids = itertools.count(1)
        self._closed = False
        self.ready_timeout = ready_timeout
        actor_class = replica_class(self.ray)
        self.infos: list[dict[str, Any]] = []   # each replica's node and engine, once they all answered
        self.actors = []
        for index in range(replicas):
            options: dict[str, Any] = {
                "name": f"{ACTOR_PREFIX}{self.group}-{index}", "namespace": NAMESPACE,
                "max_restarts": max_restarts, "max_task_retries": 0, "num_cpus": spec.threads,
                # the sequences' streams plus cancels, masks and status calls run at once
                "max_concurrency": spec.slots + 8,
            }
            if resources:
                options["resources"] = {resources[index % len(resources)]: TAG_SHARE}
            self.actors.append(actor_class.options(**options).remote(spec, index))
        try:
            self.infos = self.ray.get([actor.info.remote() for actor in self.actors], timeout=ready_timeout)
        except self.ray.exceptions.GetTimeoutError:
            self.close()
            raise EngineError(f"the {replicas} replica(s) did not all start within {ready_timeout:g} s",
                              "coli cluster status shows what the cluster has; Ray places a replica only on a "
                              "node with --threads free CPUs (and its --replica-resource tag)") from None
        except self.ray.exceptions.RayError as exc:
            self.close()
            raise EngineError(f"a replica could not start its engine: {_cause(exc)}") from None
        self.ready: dict[str, Any] = {**self.infos[0]["ready"], "replicas": replicas}
        log.info("%d replica(s) ready: %s", replicas, ", ".join(self.describe(i) for i in range(replicas)))

    # ---- placement ------------------------------------------------------------------------------------------

    @property
    def replicas(self) -> int:
        return len(self.actors)

    def place(self, slot: int) -> tuple[int, int]:
        """(replica, its local slot) of a global KV slot."""
        return slot % self.replicas, slot // self.replicas

    def describe(self, replica: int) -> str:
        return f"replica {replica} on {self.infos[replica]['node_ip']}" if replica < len(self.infos) else \
            f"replica {replica}"

    def lost(self, replica: int, exc: BaseException) -> ReplicaDied:
        return ReplicaDied(f"{self.describe(replica)} was lost ({type(exc).__name__}); Ray restarts it")

    # ---- the engine interface the server uses ---------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return not self._closed

    def submit(self, prompt: Sequence[int], *, slot: int = 0, **options: Any) -> ReplicaRequest:
        if self._closed:
            raise EngineError("the replica pool is closed")
        replica, local = self.place(slot)
        rid = next(self._ids)
        ids = [int(t) for t in prompt]
        generate = self.actors[replica].generate.options(num_returns="streaming")
        return ReplicaRequest(self, rid, slot, replica, lambda: generate.remote(rid, ids, local, options))

    def await_replacement(self, replica: int) -> None:
        """Wait (up to the ready timeout) until Ray has replaced a replica whose engine died: calls made while it
        restarts are queued by Ray and answered by the new actor, so this polls only through the old one's end."""
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            try:
                if self.ray.get(self.actors[replica].info.remote(), timeout=CALL_TIMEOUT_S)["engine_alive"]:
                    return
            except self.ray.exceptions.GetTimeoutError:
                pass
            except self.ray.exceptions.RayError as exc:
                if isinstance(exc, self.ray.exceptions.ActorDiedError):   # for good: no restart left
                    raise self.lost(replica, exc) from None
            time.sleep(REPLACEMENT_POLL_S)
        raise ReplicaDied(f"{self.describe(replica)} was not replaced within {self.ready_timeout:g} s")

    def cancel(self, request: ReplicaRequest) -> None:
        request.cancel()

    def mask(self, request: ReplicaRequest, allow: bytes) -> None:
        # waited for: the engine samples a constrained step only with its mask, and masks must arrive in order
        self._call(request.replica, "mask", request.id, allow)

    def reset(self, slot: int) -> None:
        replica, local = self.place(slot)
        self._call(replica, "reset", local)

    def stats(self, timeout: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        try:
            rows = self.ray.get([actor.stats.remote(timeout) for actor in self.actors], timeout=timeout)
        except self.ray.exceptions.RayError as exc:
            raise EngineError(f"a replica did not answer its stats: {_cause(exc)}") from None
        return merge_stats(rows)

    def _call(self, replica: int, method: str, *args: Any) -> Any:
        try:
            return self.ray.get(getattr(self.actors[replica], method).remote(*args), timeout=CALL_TIMEOUT_S)
        except self.ray.exceptions.RayError as exc:
            raise self.lost(replica, exc) from None

    def close(self) -> None:
        """Close every engine politely, then end the actors for good (no restart)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.ray.get([actor.close.remote() for actor in self.actors], timeout=CALL_TIMEOUT_S)
        except (self.ray.exceptions.RayError, ColibriError) as exc:
            log.debug("closing the replicas: %s", exc)
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)


def _cause(exc: BaseException) -> str:
    """The one line that says why, out of a Ray error's several (they quote the remote traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        raised = re.match(r"^[\w.]+(?:Error|Exception): (.+)$", line)   # the remote exception's own message
        if raised:
            return raised.group(1)
    return lines[-1] if lines else type(exc).__name__
