"""Named counters, one per branch worth watching (groupcache style).

Increments take a lock: callers add whole batches at once, so the cost is per
request, not per item. Prometheus reads the same numbers at scrape time
(exporter.py), so there is one source of truth.
"""
from __future__ import annotations

import threading

# Every counter the server may report, so `Stats` always lists the same names.
NAMES = (
    "lookups", "lookup_hits", "gets", "get_hits", "get_misses", "get_bytes",
    "bypassed", "puts", "put_stored", "put_already", "put_bytes", "rejected_full",
    "evicted_items", "evicted_bytes", "evicted_by_policy", "evicted_spare", "chunk_evictions",
    "dataset_evictions", "corrupt_dropped", "bad_requests", "dataplane_requests",
    "grpc_requests", "recovered_items", "local_reads", "put_replaced",
    "claims_granted", "claims_waited", "claims_present", "follower_flushes", "put_retagged",
    "adopted",
)


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {n: 0 for n in NAMES}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def add_many(self, items: dict[str, int]) -> None:
        with self._lock:
            for name, n in items.items():
                self._values[name] = self._values.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._values.get(name, 0)
