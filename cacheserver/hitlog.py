"""A store's hits, counted for its eviction order without waiting for its lock.

The eviction order (the policy's, and the spare entries' own) changes only
under the store's lock, and a put holds that lock while its evictions' deletes
go to RocksDB, which may wait out a write stop for seconds (stallwrite.py). A
get that took the lock to count its hits waited that long too. Now a get applies
its hits itself if the lock is free, and else queues them for the next get
that finds it free or for an eviction, which applies them before it picks
victims: the order is the same as before whenever it is used. A queue that fills (the lock
held through MAX_IDS hits: a same-host follower's batch may name 100,000 ids) drops
its oldest batches: those hits then count as older than they were, no worse, and
the holder that drains it keeps the lock for at most ~MAX_IDS accesses.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

MAX_IDS = 1 << 18  # queued hits (ids) at most: ~20 MB, drained in ~30 ms


class HitLog:
    def __init__(self, apply: Callable[[list[bytes]], None], lock: threading.Lock) -> None:
        self._apply = apply  # called with the lock held
        self._lock = lock
        self._queue: deque[list[bytes]] = deque()
        self._queued = 0  # ids in the queue
        self._qlock = threading.Lock()  # the queue's own: held for an append or a pop, never waited on long

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
            with self._qlock:
                self._queue.append(keys)
                self._queued += len(keys)
                while self._queued > MAX_IDS:
                    self._queued -= len(self._queue.popleft())

    def apply(self) -> None:
        """Apply every queued hit (lock held: only its holder takes from the queue)."""
        while self._queue:
            with self._qlock:
                if not self._queue:
                    break
                keys = self._queue.popleft()
                self._queued -= len(keys)
            self._apply(keys)
