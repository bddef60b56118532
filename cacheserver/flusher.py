"""When to flush values that skipped the RocksDB log (--durability cache).

In that mode a value lives only in the memtable until a flush writes it to a
table file: a killed process loses the unflushed ones (they are refetched as
misses; docs/operations.md), and same-host followers (localread.py) cannot
see them yet, so the server serves them over the socket. Flushing soon after
the writes pause bounds both; flushing on every write would turn each insert
into a tiny table file. RocksDB still flushes a full memtable by itself.

The policy, should_flush(), is a pure function of the write times.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

QUIET_S = 0.5  # flush once no value was written for this long...
MAX_AGE_S = 5.0  # ...or once the oldest unflushed value is this old
CHECK_S = 0.1

log = logging.getLogger(__name__)


def should_flush(now: float, dirty_since: float | None, last_write: float,
                 quiet: float = QUIET_S, max_age: float = MAX_AGE_S) -> bool:
    """True if unflushed values exist and the writes paused, or the oldest waited too long."""
    if dirty_since is None:
        return False
    return now - last_write >= quiet or now - dirty_since >= max_age


class Flusher:
    """A daemon thread that asks `dirty()` for (dirty_since, last_write) and calls `flush()`."""

    def __init__(self, dirty: Callable[[], tuple[float | None, float]], flush: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._dirty, self._flush, self._clock = dirty, flush, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-flusher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            dirty_since, last_write = self._dirty()
            if should_flush(self._clock(), dirty_since, last_write):
                try:
                    self._flush()
                except Exception:  # a failed flush is retried on the next tick; keep serving
                    log.exception("flushing the store failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
