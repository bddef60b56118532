"""Prometheus metrics read from the server's counters at scrape time."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import start_http_server
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .counters import Counters


class CacheCollector(Collector):
    def __init__(self, counters: Counters, gauges: Callable[[], dict[str, float]]) -> None:
        self._counters = counters
        self._gauges = gauges

    def collect(self) -> Iterator:
        c = CounterMetricFamily("mlcache_server_events", "Cache server events by name", labels=["name"])
        for name, value in sorted(self._counters.snapshot().items()):
            c.add_metric([name], value)
        yield c
        for name, value in self._gauges().items():
            yield GaugeMetricFamily(f"mlcache_server_{name}", name.replace("_", " "), value=value)


def serve_metrics(port: int, host: str, counters: Counters, gauges: Callable[[], dict[str, float]]):
    registry = CollectorRegistry()  # one per server, so tests may run several in a process
    registry.register(CacheCollector(counters, gauges))
    return start_http_server(port, addr=host, registry=registry)
