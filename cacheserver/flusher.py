"""When to flush values that skipped the RocksDB log (--durability cache).

In that mode a value lives only in the memtable until a flush writes it to a
table file: a killed process loses the unflushed ones (they are refetched as
misses; docs/operations.md), and same-host followers (localread.py) cannot
see them yet, so the server serves them over the socket. Flushing soon after
the writes pause bounds both; flushing on every write would turn each insert
into a tiny table file. RocksDB still flushes a full memtable by itself.
Once unflushed values are being read (served over the socket because a
follower cannot see them), a short pause is enough: an epoch of hits right
after the fill epoch would otherwise go over the socket for QUIET_S.

The policy, should_flush(), is a pure function of the write and read times.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

QUIET_S = 0.5  # flush once no value was written for this long...
MAX_AGE_S = 5.0  # ...or once the oldest unflushed value is this old...
READ_QUIET_S = 0.05  # ...or, when unflushed values were read since the last write, after this
READ_FLUSH_GAP_S = 0.5  # (those early flushes at most this often: no storm of tiny table files)
CHECK_S = 0.1

log = logging.getLogger(__name__)


def should_flush(now: float, dirty_since: float | None, last_write: float, last_unflushed_read: float = 0.0,
                 last_flush: float = float("-inf"), quiet: float = QUIET_S, max_age: float = MAX_AGE_S,
                 read_quiet: float = READ_QUIET_S, read_gap: float = READ_FLUSH_GAP_S) -> bool:
    """True if unflushed values exist and the writes paused (briefly will do when those
    values are being read, unless such a flush was just made), or the oldest waited too long."""
    if dirty_since is None:
        return False
    paused = now - last_write
    return (paused >= quiet or now - dirty_since >= max_age
            or (last_unflushed_read > last_write and paused >= read_quiet and now - last_flush >= read_gap))


class Flusher:
    """A daemon thread that asks `dirty()` for (dirty_since, last_write, last_unflushed_read)
    and calls `flush()`."""

    def __init__(self, dirty: Callable[[], tuple[float | None, float, float]], flush: Callable[[], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._dirty, self._flush, self._clock = dirty, flush, clock
        self._last_flush = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-flusher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            if should_flush(self._clock(), *self._dirty(), self._last_flush):
                self._last_flush = self._clock()
                try:
                    self._flush()
                except Exception:  # a failed flush is retried on the next tick; keep serving
                    log.exception("flushing the store failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def lost_values(get: Callable[[bytes], object], entries: Iterable[tuple], mark: int) -> list[bytes]:
    """The ids of index entries (seq, id, ...) whose value a killed process never flushed.

    With durability "cache" the index entry is logged before its value is written
    unlogged; a value is safe once a flush that started after it completed (the
    durable mark: every sequence number below it). Only the entries from the mark
    on are checked, a few seconds of inserts; all of them after a salvage
    (salvage.py, mark 0), which may have dropped any value."""
    lost = []
    for seq, key, *_ in entries:
        if seq < mark:
            continue
        try:
            present = get(key) is not None
        except Exception:  # RocksDB reports corruption as an exception
            present = False
        if not present:
            lost.append(key)
    return lost
