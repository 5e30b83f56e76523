"""What ``GET /experts`` and ``GET /profile`` report: the engine's expert cache, and the last requests' figures.

``/experts`` is the engine's ``stats`` op (docs/protocol.md) reshaped per layer. The op is a round trip to the
engine, answered between two of its steps, so concurrent readers (several dashboards polling) share one answer
that is at most :data:`STATS_MAX_AGE_S` old instead of queueing a round trip each.

``/profile`` keeps the ``done`` event of each of the last :data:`PROFILE_KEEP` sequences, with the disk bound of
its decode phase: bandwidth / ((1 - decode hit rate) x routed bytes per token), the formula docs/benchmarks.md
uses (colibri/disk_bound.py). The bandwidth is ``coli serve --disk-bw``, else the ``coli tune`` profile's, else what
``coli plan --measure-disk`` measured earlier on the disk holding the model; without any the bound is unknown
(``null``), never guessed.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any

from ..disk_bound import DiskBound
from ..errors import EngineError
from .engine_host import EngineHost
from .errors import APIError

STATS_MAX_AGE_S = 0.5
STATS_TIMEOUT_S = 30.0
PROFILE_KEEP = 256
PHASES = ("io_wait_s", "expert_s", "attention_s", "other_s")
TOTALS = ("expert_hits", "expert_misses", "hit_rate", "expert_bytes_read", "expert_reads", "prefilled_tokens",
          "generated_tokens", "rss_bytes", "pin", "policy", "prefetch", "io", "lossy")
PER_LAYER = ("hits", "misses", "bytes_read", "reads", "experts", "cache_slots", "uses", "resident")


def _number(event: dict[str, Any], name: str) -> float:
    value = event.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def io_wait_share(phases: dict[str, Any]) -> float | None:
    """The share of a sequence's engine time spent waiting for expert reads (None without phase timings)."""
    total = sum(_number(phases, p) for p in PHASES)
    return _number(phases, "io_wait_s") / total if total > 0 else None


class Profile:
    """The last :data:`PROFILE_KEEP` sequences' figures, newest last. ``record`` is called on the event loop."""

    def __init__(self, disk: DiskBound | None = None, keep: int = PROFILE_KEEP):
        self.disk = disk or DiskBound()
        self._records: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()
        self._count = 0

    def record(self, done: dict[str, Any], route: str, slot: int, user: str | None = None) -> None:
        """Keep one sequence's ``done`` figures; ``user`` is the request's own label (``coli chat --attach`` finds
        its turns by it)."""
        decode: dict[str, Any] = done["decode"] if isinstance(done.get("decode"), dict) else {}
        decode_hit = _number(decode, "hit_rate") if decode else _number(done, "hit_rate")
        share = self.disk.share(done)
        decode_tps = _number(done, "decode_tps")
        prompt = int(_number(done, "prompt_tokens"))
        prefilled = int(_number(done, "prefilled_tokens"))
        with self._lock:
            self._count += 1
            self._records.append({
                "seq": self._count, "route": route, "slot": slot, "user": user, "finished_at": time.time(),
                "reason": done.get("reason"), "prompt_tokens": prompt, "cached_tokens": max(0, prompt - prefilled),
                "prefilled_tokens": prefilled, "generated_tokens": int(_number(done, "generated_tokens")),
                "prefill_tps": _number(done, "prefill_tps"), "decode_tps": decode_tps,
                "hit_rate": _number(done, "hit_rate"), "bytes_read": int(_number(done, "bytes_read")),
                "reads": int(_number(done, "reads")), "io_wait_share": io_wait_share(done),
                "rss_bytes": int(_number(done, "rss_bytes")),
                "decode": {"hit_rate": decode_hit, "bytes_read": int(_number(decode, "bytes_read")),
                           "io_wait_share": io_wait_share(decode) if decode else None},
                "disk_bound_tps": share["disk_bound_tps"], "share_of_disk_bound": share["share_of_disk_bound"],
            })

    def latest_share(self) -> float:
        """The latest sequence's decode speed as a share of the disk bound; NaN when unknown or none ran."""
        last = self.last(1)
        share = last[0]["share_of_disk_bound"] if last else None
        return float(share) if share is not None else float("nan")

    def last(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._records)[-n:] if n > 0 else []

    @property
    def count(self) -> int:
        return self._count


class EngineStats:
    """The engine's ``stats`` answer, shared by readers that ask within :data:`STATS_MAX_AGE_S` of each other
    while no sequence ended (a reader that saw its request finish must see that request in the counts)."""

    def __init__(self, host: EngineHost, profile: Profile, max_age: float = STATS_MAX_AGE_S):
        self.host = host
        self.profile = profile
        self.max_age = max_age
        self._last: tuple[Any, int, float, dict[str, Any]] | None = None   # (engine, sequences, time, stats)
        self._pending: asyncio.Future | None = None

    async def get(self) -> dict[str, Any]:
        engine = await self.host.engine(timeout=0.0)
        last = self._last
        if (last is not None and last[0] is engine and last[1] == self.profile.count
                and time.monotonic() - last[2] < self.max_age):
            return last[3]
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(asyncio.to_thread(self._ask, engine, self.profile.count))
        try:
            return await asyncio.shield(self._pending)
        except EngineError as exc:
            raise APIError(503, f"engine unavailable: {exc.one_line()}", code="engine_unavailable",
                           headers={"Retry-After": "2"}) from None

    def _ask(self, engine: Any, sequences: int) -> dict[str, Any]:
        stats = engine.stats(timeout=STATS_TIMEOUT_S)
        self._last = (engine, sequences, time.monotonic(), stats)
        return stats


def experts_view(stats: dict[str, Any]) -> dict[str, Any]:
    """The ``stats`` event as ``GET /experts`` answers it: totals, then one entry per MoE layer (``uses`` and
    ``resident`` per expert, ``null`` from an engine that does not report them)."""
    layers: list[Any] = stats["layers"] if isinstance(stats.get("layers"), list) else []
    out_layers = []
    for i, layer in enumerate(layers):
        entry: dict[str, Any] = {"layer": layer}
        for name in PER_LAYER:
            values = stats.get(name)
            entry[name] = values[i] if isinstance(values, list) and i < len(values) else None
        lookups = (entry["hits"] or 0) + (entry["misses"] or 0)
        entry["hit_rate"] = (entry["hits"] or 0) / lookups if lookups else None
        out_layers.append(entry)
    totals: dict[str, Any] = {name: stats[name] for name in TOTALS if name in stats}
    return {**totals, "layers": out_layers}
