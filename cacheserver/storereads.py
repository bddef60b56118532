"""A store's reads (Store's part): presence with hits counted, and values, served without
the store's lock (hits are applied later: hitlog.py); a record that fails its check on
read is deleted, counted (`corrupt_dropped`) and answered as a miss, the read waiting out no
write stop (its delete then left for the first flush once writes go again: Store._delete_soon).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from .record import strip, unwrap

DROP_LOCK_WAIT_S = 0.05  # a get waits this long at most to drop a corrupt record: longer is a writer's stop


class Reads:
    """Mixed into Store (store.py): the attributes and methods used here are the Store's."""
    _db: Any
    _large: Any
    _lock: threading.Lock
    _index: dict[bytes, tuple[int, int]]
    _aged: Any
    _unflushed: dict[bytes, int]
    _hits: Any
    plain: bool
    counters: Any
    _delete_soon: Any  # Store's

    def touch(self, keys: Sequence[bytes]) -> bytes:
        """Presence flags, counted as accesses by the eviction policy."""
        return self.touch_split(keys)[0]

    def touch_split(self, keys: Sequence[bytes]) -> tuple[bytes, list[int]]:
        """touch(), and the positions of present values a same-host follower cannot read
        from the files: those not flushed yet (durability "cache") and large ones (their
        family, in blob files, followers do not open: a RocksDB secondary crashes reading a blob).
        Without the lock, as get_many: an entry is in _unflushed before it is indexed (put_many)."""
        index = self._index
        present = bytes(1 if k in index else 0 for k in keys)
        self._hits.add([k for k, p in zip(keys, present) if p])
        unflushed, aged = self._unflushed, self._aged
        late = [i for i, k in enumerate(keys) if present[i] and k in unflushed] if unflushed else []
        if late:
            self._last_unflushed_read = time.monotonic()
        if aged:
            late = sorted(set(late).union(i for i, k in enumerate(keys) if present[i] and k in aged))
        return present, late

    def get_many(self, keys: Sequence[bytes], trailer: bool = True) -> list[memoryview | None]:
        """Values (trailer stripped, zero-copy views) or None for misses. trailer=False
        skips the xxh3 check: only for a reader that authenticates every value itself.
        In a plain store the values as stored (bytes), RocksDB's checksums checked."""
        out: list[memoryview | None] = []
        bad: list[tuple[bytes, tuple[int, int]]] = []  # (id, the index entry its read found wanting)
        get, large, aged, index, plain = self._db.get, self._large.get, self._aged, self._index, self.plain
        for k in keys:
            entry = index.get(k)
            if entry is None:  # not stored (a put's value is indexed once written): a miss, no RocksDB read
                out.append(None)
                continue
            try:
                raw = (large(k) if k in aged else None) or get(k)  # get: a large one from before the family
            except Exception:  # RocksDB reports corruption as an exception
                raw, bad_read = None, True
            else:
                bad_read = False
            if raw is None:
                if bad_read or index.get(k) is entry:  # meta without value (not one evicted meanwhile): drop it
                    bad.append((k, entry))
                out.append(None)
                continue
            value = raw if plain else unwrap(raw) if trailer else strip(raw)
            if value is None:
                bad.append((k, entry))
            out.append(value)
        self._hits.add([k for k, v in zip(keys, out) if v is not None])  # a hit never waits for the lock
        if bad:
            self._drop_bad(bad)
        return out

    def _drop_bad(self, bad: list[tuple[bytes, tuple[int, int]]]) -> None:
        """Drop records that failed their read, each only while the index holds the entry its read
        found: an id dropped by another reader and put again since holds a new, good value. The get
        waits for no write stop: not for the lock, which a put may hold through one (then a later
        read that finds the record drops it; it is a miss at each), nor for the delete (_delete_soon)."""
        if not self._lock.acquire(timeout=DROP_LOCK_WAIT_S):
            return
        try:
            drop = [k for k, entry in bad if self._index.get(k) is entry]
            for k in drop:
                self._index_remove(k)
            if drop:
                self.counters.add("corrupt_dropped", len(drop))
                self._delete_soon(drop)
        finally:
            self._lock.release()
