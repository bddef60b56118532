"""Named counters, one per branch worth watching (groupcache style).

Every counter is declared: a Counters object knows its names from the start
(so `Stats` always lists the same ones) and refuses any other, so a misspelt
name fails where it is added instead of quietly becoming a new counter.
Increments take a lock: callers add whole batches at once, so the cost is per
request, not per item. Prometheus reads the same numbers at scrape time
(exporter.py), so there is one source of truth.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable

# Every counter a cache server reports.
SERVER_COUNTERS = (
    "lookups", "lookup_hits", "gets", "get_hits", "get_misses", "get_bytes",
    "bypassed", "puts", "put_stored", "put_already", "put_bytes", "rejected_full",
    "evicted_items", "evicted_bytes", "evicted_by_policy", "evicted_spare", "chunk_evictions",
    "dataset_evictions", "corrupt_dropped", "bad_requests", "dataplane_requests",
    "grpc_requests", "recovered_items", "local_reads", "put_replaced",
    "claims_granted", "claims_waited", "claims_present", "claims_released", "follower_flushes", "put_retagged",
    "adopted", "local_inline", "flushes", "recovered_unflushed_dropped",
    # issue 12: salvage, disk full, bounded answers, accept errors, admission control
    "salvage_orphans_dropped", "rejected_disk_full", "get_cut_for_size", "accept_errors",
    "busy_refused", "request_timeouts", "reply_stalls", "disk_waits", "relocated_items", "relocated_bytes",
    "grpc_overdeclared", "retag_stopped",
)


class UndeclaredCounter(KeyError):
    """A counter name the Counters object was not created with."""


class Counters:
    def __init__(self, names: Iterable[str] = SERVER_COUNTERS) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {n: 0 for n in names}

    def _undeclared(self, name: str) -> UndeclaredCounter:
        return UndeclaredCounter(f"counter {name!r} is not declared (declared: {', '.join(self._values)})")

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            if name not in self._values:
                raise self._undeclared(name)
            self._values[name] += n

    def add_many(self, items: dict[str, int]) -> None:
        with self._lock:
            for name in items:
                if name not in self._values:
                    raise self._undeclared(name)
            for name, n in items.items():
                self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            if name not in self._values:
                raise self._undeclared(name)
            return self._values[name]
