"""Counters for ``GET /metrics`` in the Prometheus text exposition format (no client library needed).

Token and expert-cache figures come from the engine's ``done`` events (its own truth, including sequences a
client abandoned); request counts and latencies from the routes. Gauges (queue depth, slots in use, engine up)
are read at scrape time.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping
from typing import Any

PREFIX = "colibri_"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()   # (route, status)
        self.failures: collections.Counter[str] = collections.Counter()
        self.rejections: collections.Counter[str] = collections.Counter()
        self.started = 0
        self.finished = 0
        self.prompt_tokens = 0
        self.prefilled_tokens = 0
        self.generated_tokens = 0
        self.expert_hits = 0
        self.expert_misses = 0
        self.bytes_read = 0
        self.reads = 0
        self.sequences = 0
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.last_prefill_tps = 0.0
        self.last_decode_tps = 0.0
        self.request_seconds = 0.0
        self.rss_bytes = 0

    def count_response(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def request_started(self) -> None:
        with self._lock:
            self.started += 1

    def request_finished(self, seconds: float) -> None:
        with self._lock:
            self.finished += 1
            self.request_seconds += seconds

    def request_failed(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] += 1

    def rejected(self, reason: str) -> None:
        with self._lock:
            self.rejections[reason] += 1

    def engine_done(self, done: dict[str, Any]) -> None:
        """Fold one ``done`` event's per-sequence figures into the totals."""
        def num(name: str) -> float:
            value = done.get(name, 0)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

        with self._lock:
            self.sequences += 1
            self.prompt_tokens += int(num("prompt_tokens"))
            prefilled = int(num("prefilled_tokens"))
            generated = int(num("generated_tokens"))
            self.prefilled_tokens += prefilled
            self.generated_tokens += generated
            self.expert_hits += int(num("expert_hits"))
            self.expert_misses += int(num("expert_misses"))
            self.bytes_read += int(num("bytes_read"))
            self.reads += int(num("reads"))
            if num("rss_bytes"):
                self.rss_bytes = int(num("rss_bytes"))
            if num("prefill_tps") > 0 and prefilled:
                self.last_prefill_tps = num("prefill_tps")
                self.prefill_seconds += prefilled / self.last_prefill_tps
            if num("decode_tps") > 0 and generated:
                self.last_decode_tps = num("decode_tps")
                self.decode_seconds += generated / self.last_decode_tps

    def render(self, gauges: Mapping[str, tuple[str, float]]) -> str:
        """The exposition text; ``gauges`` maps a name to (help, value) read at scrape time."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {PREFIX}{name} {help_text}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            for labels, value in samples:
                lines.append(f"{PREFIX}{name}{labels} {_number(value)}")

        with self._lock:
            metric("requests_total", "counter", "HTTP responses by route and status code",
                   [(f'{{route="{r}",code="{c}"}}', n) for (r, c), n in sorted(self.requests.items())])
            metric("generations_started_total", "counter", "generations submitted to the engine",
                   [("", self.started)])
            metric("generations_completed_total", "counter", "generations that ran to their end",
                   [("", self.finished)])
            metric("generations_failed_total", "counter", "generations that ended early, by reason",
                   [(f'{{reason="{r}"}}', n) for r, n in sorted(self.failures.items())])
            metric("rejected_total", "counter", "requests refused before generation, by reason",
                   [(f'{{reason="{r}"}}', n) for r, n in sorted(self.rejections.items())])
            metric("prompt_tokens_total", "counter", "prompt tokens of finished sequences", [("", self.prompt_tokens)])
            metric("prefilled_tokens_total", "counter",
                   "prompt tokens actually computed (the rest came from a slot's cached prefix)",
                   [("", self.prefilled_tokens)])
            metric("generated_tokens_total", "counter", "tokens generated", [("", self.generated_tokens)])
            metric("prefill_tokens_per_second", "gauge", "prefill speed of the latest sequence",
                   [("", self.last_prefill_tps)])
            metric("decode_tokens_per_second", "gauge", "decode speed of the latest sequence",
                   [("", self.last_decode_tps)])
            avg_decode = self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0
            metric("decode_tokens_per_second_average", "gauge", "generated tokens over decode time, all sequences",
                   [("", avg_decode)])
            metric("expert_cache_hits_total", "counter", "routed-expert cache hits", [("", self.expert_hits)])
            metric("expert_cache_misses_total", "counter", "routed-expert cache misses", [("", self.expert_misses)])
            lookups = self.expert_hits + self.expert_misses
            metric("expert_cache_hit_rate", "gauge", "expert cache hits over lookups, all sequences",
                   [("", self.expert_hits / lookups if lookups else 0.0)])
            metric("expert_bytes_read_total", "counter", "bytes of routed experts read from disk",
                   [("", self.bytes_read)])
            metric("expert_reads_total", "counter", "expert read operations", [("", self.reads)])
            metric("engine_rss_bytes", "gauge", "engine resident memory at the latest sequence end",
                   [("", self.rss_bytes)])
        for name, (help_text, value) in gauges.items():
            metric(name, "gauge", help_text, [("", value)])
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


GaugeSource = Callable[[], dict[str, tuple[str, float]]]
