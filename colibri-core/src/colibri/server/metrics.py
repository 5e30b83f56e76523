"""``GET /metrics`` in Prometheus' text exposition format, written by ``prometheus_client``.

Token and expert-cache figures come from the engine's ``done`` events (its own truth, including sequences a
client abandoned); request counts from the routes. Gauges (queue depth, slots in use, engine up) are read at
scrape time. Latency histograms: time to first token and the time between consecutive tokens (both stamped where
the engine's events arrive, so a slow client does not skew them), and each HTTP request's duration by route
(stamped by the access log, so a streamed response counts until its last byte).

The totals are kept here (they fold several fields of one event under one lock) and exposed through a custom
collector, which keeps every existing metric name exactly; each ``Metrics`` has its own registry, so two apps
in one process never share a series.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "colibri_"
# Seconds. A streamed MoE prefill can take minutes; a decode step on a cold cache, seconds.
FIRST_TOKEN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_GAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


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
        self.registry = CollectorRegistry(auto_describe=False)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "from receiving a generation request to its first token",
            buckets=FIRST_TOKEN_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds", "time between consecutive generated tokens of one request",
            buckets=TOKEN_GAP_BUCKETS, registry=self.registry)
        self.request_duration = Histogram(
            PREFIX + "request_duration_seconds", "HTTP request duration until the response's last byte, by route",
            ["route"], buckets=REQUEST_BUCKETS, registry=self.registry)
        self.registry.register(_Totals(self))

    def token_clock(self, started: float) -> TokenClock:
        """A per-request clock that observes the first token's latency from ``started``, then each gap."""
        return TokenClock(self, started)

    def observe_request(self, route: str, seconds: float) -> None:
        self.request_duration.labels(route).observe(seconds)

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

    def summary(self) -> dict[str, Any]:
        """The totals as JSON (``GET /profile``): what the Prometheus text carries, for a page to read."""
        with self._lock:
            lookups = self.expert_hits + self.expert_misses
            return {"sequences": self.sequences, "prompt_tokens": self.prompt_tokens,
                    "prefilled_tokens": self.prefilled_tokens, "generated_tokens": self.generated_tokens,
                    "expert_hits": self.expert_hits, "expert_misses": self.expert_misses,
                    "hit_rate": self.expert_hits / lookups if lookups else None, "bytes_read": self.bytes_read,
                    "reads": self.reads, "rss_bytes": self.rss_bytes, "last_prefill_tps": self.last_prefill_tps,
                    "last_decode_tps": self.last_decode_tps,
                    "decode_tps_average": self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0}

    def render(self, gauges: Mapping[str, tuple[str, float]]) -> str:
        """The exposition text; ``gauges`` maps a name to (help, value) read at scrape time."""
        return generate_latest(_Scrape(self.registry, gauges)).decode("utf-8")

    def families(self) -> Iterator[Metric]:
        """The totals as metric families (what the custom collector yields)."""
        def family(kind, name: str, help_text: str, labels: tuple[str, ...] = (), samples=()) -> Metric:
            metric = kind(PREFIX + name, help_text, labels=list(labels))
            for label_values, value in samples:
                metric.add_metric(list(label_values), value)
            return metric

        def counter(name, help_text, value):
            return family(CounterMetricFamily, name, help_text, samples=[((), value)])

        def gauge(name, help_text, value):
            return family(GaugeMetricFamily, name, help_text, samples=[((), value)])

        with self._lock:
            lookups = self.expert_hits + self.expert_misses
            avg_decode = self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0
            out = [
                family(CounterMetricFamily, "requests_total", "HTTP responses by route and status code",
                       ("route", "code"), [((r, str(c)), n) for (r, c), n in sorted(self.requests.items())]),
                counter("generations_started_total", "generations submitted to the engine", self.started),
                counter("generations_completed_total", "generations that ran to their end", self.finished),
                family(CounterMetricFamily, "generations_failed_total", "generations that ended early, by reason",
                       ("reason",), [((r,), n) for r, n in sorted(self.failures.items())]),
                family(CounterMetricFamily, "rejected_total", "requests refused before generation, by reason",
                       ("reason",), [((r,), n) for r, n in sorted(self.rejections.items())]),
                counter("prompt_tokens_total", "prompt tokens of finished sequences", self.prompt_tokens),
                counter("prefilled_tokens_total",
                        "prompt tokens actually computed (the rest came from a slot's cached prefix)",
                        self.prefilled_tokens),
                counter("generated_tokens_total", "tokens generated", self.generated_tokens),
                gauge("prefill_tokens_per_second", "prefill speed of the latest sequence", self.last_prefill_tps),
                gauge("decode_tokens_per_second", "decode speed of the latest sequence", self.last_decode_tps),
                gauge("decode_tokens_per_second_average", "generated tokens over decode time, all sequences",
                      avg_decode),
                counter("expert_cache_hits_total", "routed-expert cache hits", self.expert_hits),
                counter("expert_cache_misses_total", "routed-expert cache misses", self.expert_misses),
                gauge("expert_cache_hit_rate", "expert cache hits over lookups, all sequences",
                      self.expert_hits / lookups if lookups else 0.0),
                counter("expert_bytes_read_total", "bytes of routed experts read from disk", self.bytes_read),
                counter("expert_reads_total", "expert read operations", self.reads),
                gauge("engine_rss_bytes", "engine resident memory at the latest sequence end", self.rss_bytes),
            ]
        return iter(out)


class TokenClock:
    """One request's token timing: the first token's latency from the request's start, then each token's gap
    to the one before. Called from the thread that reads the engine's events (the histograms are thread-safe)."""

    def __init__(self, metrics: Metrics, started: float):
        self.metrics = metrics
        self.started = started
        self.last: float | None = None

    def token(self) -> None:
        now = time.monotonic()
        if self.last is None:
            self.metrics.time_to_first_token.observe(now - self.started)
        else:
            self.metrics.time_per_output_token.observe(now - self.last)
        self.last = now


class _Totals:
    """The custom collector over :class:`Metrics`' totals."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self.metrics.families()


class _Scrape:
    """One scrape: the registry's families, then the gauges read for it."""

    def __init__(self, registry: CollectorRegistry, gauges: Mapping[str, tuple[str, float]]):
        self.registry = registry
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()
        for name, (help_text, value) in self.gauges.items():
            yield GaugeMetricFamily(PREFIX + name, help_text, value=value)


GaugeSource = Callable[[], dict[str, tuple[str, float]]]
