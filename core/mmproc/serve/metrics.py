"""The render service's Prometheus metrics (``GET /metrics``).

* ``mmproc_requests_total{endpoint, status}`` and ``mmproc_errors_total{endpoint, kind}``;
* ``mmproc_request_seconds{endpoint, stage}``: a histogram per stage of a request (``queue``:
  waiting for a render slot; ``render``: the chat template, the media and the pipeline;
  ``engine``: sending to the engine and its acknowledgement, on the native path; ``encode``: the
  items in vLLM's format; ``serialise``: the JSON; ``total``);
* ``mmproc_requests_in_flight``;
* ``mmproc_cache_hits_total``, ``mmproc_cache_misses_total``, ``mmproc_cache_entries``,
  ``mmproc_cache_stand_ins`` (entries whose tensors only the engine keeps) and
  ``mmproc_cache_bytes``: the processor-output cache (read from ``cache.stats()`` when scraped);
* ``mmproc_stand_in_misses_total{endpoint}``: requests rendered again because the engine lacked
  an item the cache kept only a stand-in of;
* with an engine, ``mmproc_engine_*``: the wire sender's counters (``RequestSender.stats``:
  requests, messages, bytes, items in full and by reference, re-sends, acknowledged, refused,
  given up) and gauges (unsettled requests, items the engine is taken to hold, their bytes).

Each server has a registry of its own, so several in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics"]

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _CacheCollector:
    """The processor-output cache's counters, read at scrape time."""

    def __init__(self, processor: Any) -> None:
        self._processor = processor

    def collect(self) -> Iterator[Any]:
        stats = self._processor.cache.stats()
        yield CounterMetricFamily(
            "mmproc_cache_hits", "Items the processor-output cache answered", value=stats.hits
        )
        yield CounterMetricFamily(
            "mmproc_cache_misses", "Items the processor-output cache missed", value=stats.misses
        )
        yield GaugeMetricFamily(
            "mmproc_cache_entries", "Items in the processor-output cache", value=stats.entries
        )
        yield GaugeMetricFamily(
            "mmproc_cache_stand_ins",
            "Items of the processor-output cache whose tensors only the engine keeps",
            value=stats.stand_ins,
        )
        yield GaugeMetricFamily(
            "mmproc_cache_bytes", "Bytes the processor-output cache holds", value=stats.nbytes
        )


# SenderStats fields that only go up; the others are gauges of the sender's state now.
_SENDER_GAUGES = frozenset({"unsettled", "items_held", "held_bytes"})


class _SenderCollector:
    """The engine link's wire counters, read at scrape time."""

    def __init__(self, sender: Any) -> None:
        self._sender = sender

    def collect(self) -> Iterator[Any]:
        for name, value in self._sender.stats.as_dict().items():
            documentation = f"Engine wire sender: {name.replace('_', ' ')}"
            if name in _SENDER_GAUGES:
                yield GaugeMetricFamily(f"mmproc_engine_{name}", documentation, value=value)
            else:
                yield CounterMetricFamily(f"mmproc_engine_{name}", documentation, value=value)


class ServerMetrics:
    """One server's metrics, in a registry of its own."""

    def __init__(self, processor: Any) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mmproc_requests",
            "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "mmproc_errors",
            "Requests refused or failed, by endpoint and error type",
            ["endpoint", "kind"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "mmproc_request_seconds",
            "Seconds a request spent in each stage",
            ["endpoint", "stage"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "mmproc_requests_in_flight", "Requests being answered now", registry=self.registry
        )
        self.stand_in_misses = Counter(
            "mmproc_stand_in_misses",
            "Requests rendered again: the engine lacked an item the cache kept a stand-in of",
            ["endpoint"],
            registry=self.registry,
        )
        self.registry.register(_CacheCollector(processor))

    def watch_engine(self, sender: Any) -> None:
        """Export ``sender``'s wire counters (its ``stats``, a `SenderStats`: a `RequestSender`
        or the engine link's snapshot of one) with the server's."""
        self.registry.register(_SenderCollector(sender))

    def observe(self, endpoint: str, stage: str, seconds: float) -> None:
        """Count ``seconds`` in ``stage`` of a request to ``endpoint``."""
        self.seconds.labels(endpoint, stage).observe(seconds)

    def count_stand_in_miss(self, endpoint: str) -> None:
        """Count a request to ``endpoint`` rendered again for the engine's lack of an item."""
        self.stand_in_misses.labels(endpoint).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus's text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
