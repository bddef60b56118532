"""A store's hits, counted for its eviction order without waiting for its lock.

The eviction order (the policy's, and the spare entries' own) changes only
under the store's lock, and a put holds that lock while its evictions' deletes
go to RocksDB, which may wait out a write stop for seconds (stallwrite.py). A
get that took the lock to count its hits waited that long too. Now a get applies
its hits itself if the lock is free, and else queues them for the next get
that finds it free or for an eviction, which applies them before it picks
victims: the order is the same as before whenever it is used. A queue that fills (the lock
held through about MAX_BATCHES gets) drops its oldest batches: those hits then
count as older than they were, no worse.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

MAX_BATCHES = 4096  # a batch is one call's hits (a get: at most one group of ids, getbound.py)


class HitLog:
    def __init__(self, apply: Callable[[list[bytes]], None], lock: threading.Lock) -> None:
        self._apply = apply  # called with the lock held
        self._lock = lock
        self._queue: deque[list[bytes]] = deque(maxlen=MAX_BATCHES)

    def add(self, keys: list[bytes]) -> None:
        """Count these hits: now if the lock is free, else once its holder (or the next get) applies them."""
        if self._lock.acquire(blocking=False):
            try:
                self.apply()  # older hits first
                if keys:
                    self._apply(keys)
            finally:
                self._lock.release()
        elif keys:
            self._queue.append(keys)

    def apply(self) -> None:
        """Apply every queued hit (lock held: only its holder takes from the queue)."""
        queue, apply = self._queue, self._apply
        while queue:
            apply(queue.popleft())
