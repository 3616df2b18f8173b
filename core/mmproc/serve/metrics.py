"""The render service's Prometheus metrics (``GET /metrics``).

* ``mmproc_requests_total{endpoint, status}`` and ``mmproc_errors_total{endpoint, kind}``;
* ``mmproc_request_seconds{endpoint, stage}``: a histogram per stage of a request (``queue``:
  waiting for a render slot; ``render``: the chat template, the media and the pipeline;
  ``engine``: sending to the engine and its acknowledgement, on the native path; ``encode``: the
  items in vLLM's format; ``serialise``: the JSON; ``total``);
* ``mmproc_requests_in_flight``;
* ``mmproc_cache_hits_total``, ``mmproc_cache_misses_total``, ``mmproc_cache_entries`` and
  ``mmproc_cache_bytes``: the processor-output cache (read from ``cache.stats()`` when scraped).

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
            "mmproc_cache_bytes", "Bytes the processor-output cache holds", value=stats.nbytes
        )


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
        self.registry.register(_CacheCollector(processor))

    def observe(self, endpoint: str, stage: str, seconds: float) -> None:
        """Count ``seconds`` in ``stage`` of a request to ``endpoint``."""
        self.seconds.labels(endpoint, stage).observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus's text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
