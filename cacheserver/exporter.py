"""Prometheus metrics read from the server's counters at scrape time."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import start_http_server
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .counters import Counters


class CacheCollector(Collector):
    def __init__(self, counters: Counters, gauges: Callable[[], dict[str, float]],
                 replacers: Callable[[], dict[str, int]] = dict) -> None:
        self._counters = counters
        self._gauges = gauges
        self._replacers = replacers

    def collect(self) -> Iterator:
        c = CounterMetricFamily("mlcache_server_events", "Cache server events by name", labels=["name"])
        for name, value in sorted(self._counters.snapshot().items()):
            c.add_metric([name], value)
        yield c
        r = CounterMetricFamily("mlcache_server_replaces", "Entries overwritten (replace puts) by client identity",
                                labels=["peer"])
        for peer, value in sorted(self._replacers().items()):
            r.add_metric([peer], value)
        yield r
        for name, value in self._gauges().items():
            yield GaugeMetricFamily(f"mlcache_server_{name}", name.replace("_", " "), value=value)


def serve_metrics(port: int, host: str, counters: Counters, gauges: Callable[[], dict[str, float]],
                  replacers: Callable[[], dict[str, int]] = dict):
    registry = CollectorRegistry()  # one per server, so tests may run several in a process
    registry.register(CacheCollector(counters, gauges, replacers))
    return start_http_server(port, addr=host, registry=registry)
