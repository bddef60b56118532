"""Prometheus metrics for the manager, read from the state at scrape time.

Counters that describe decisions (allocation changes, probes, evictions, ring
changes) live in the journaled state, so they keep counting across restarts
instead of dropping to zero; process counters (RPCs, server calls, journal
writes) are per process, as Prometheus expects for ``_total`` resets.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cacheserver.proto import manager_pb2 as mpb
from cacheserver.vocab import CacheMode, Option

# The manager process's own counters (cacheserver/counters.py): one per RPC, and
# its calls to the servers. batch_reports_repeated: a numbered batch report sent
# again (its reply was lost) is not journaled, so it is counted here, per process.
MANAGER_COUNTERS = ("server_calls", "server_call_failures", "reconciles", "reconcile_fixes", "job_token_refused",
                    "server_refused", "chunk_evictions_skipped", "batch_reports_repeated",
                    "plan_versions_lifted", "server_calls_stuck",
                    *(f"rpc_{m.name}" for m in mpb.DESCRIPTOR.services_by_name["Manager"].methods))

# Decision counters kept in the state (model.counters), always exported: every name
# the model counts (tests/test_review_manager_metrics_s29.py checks none is left out).
DECISION_COUNTERS = ("decisions", "probes_started", "probes_finished", "probes_aborted", "mode_switches",
                     "chunk_evictions", "chunk_evictions_forced", "ring_changes", "autocache_decisions")


def gather(store: Any, counters: Any) -> dict[str, Any]:
    """One consistent reading of everything exported (also handy in tests)."""
    def read(m) -> dict[str, Any]:
        options: dict[str, int] = {o.value: 0 for o in (Option.NONE, Option.CHUNKED, Option.FULL)}
        for ds in m.datasets:
            options[m.option(ds).value] += 1
        return {
            "decision": {n: m.counters.get(n, 0) for n in DECISION_COUNTERS},
            "ring_size": len(m.registry.addresses()), "ring_version": m.registry.version,
            "servers_known": len(m.registry.servers), "jobs": len(m.jobs),
            "jobs_probing": sum(1 for p in m.board.jobs.values() if p.probing),
            "jobs_bypass": sum(1 for p in m.board.jobs.values() if p.mode is CacheMode.BYPASS),
            "datasets": options, "budget_bytes": m.budget(),
            "allocated_bytes": sum(a.bytes for a in m.allocs.values()),
            "journal_seq": store.seq,
        }
    out = store.read(read)
    out["process"] = counters.snapshot()
    out["process"]["journal_events"] = store.events_written
    out["process"]["snapshots"] = store.snapshots
    return out


class ManagerCollector(Collector):
    def __init__(self, reading: Callable[[], dict[str, Any]]) -> None:
        self._reading = reading

    def collect(self) -> Iterator:
        r = self._reading()
        for name, value in r["decision"].items():
            yield CounterMetricFamily(f"mlcache_manager_{name}", name.replace("_", " "), value=value)
        p = CounterMetricFamily("mlcache_manager_events", "Manager process events by name", labels=["name"])
        for name, value in sorted(r["process"].items()):
            p.add_metric([name], value)
        yield p
        for name in ("ring_size", "ring_version", "servers_known", "jobs", "jobs_probing", "jobs_bypass",
                     "budget_bytes", "allocated_bytes", "journal_seq"):
            yield GaugeMetricFamily(f"mlcache_manager_{name}", name.replace("_", " "), value=r[name])
        g = GaugeMetricFamily("mlcache_manager_datasets", "Datasets by cache option", labels=["option"])
        for opt, n in sorted(r["datasets"].items()):
            g.add_metric([opt], n)
        yield g


def serve_metrics(port: int, host: str, reading: Callable[[], dict[str, Any]]):
    registry = CollectorRegistry()
    registry.register(ManagerCollector(reading))
    return start_http_server(port, addr=host, registry=registry)
