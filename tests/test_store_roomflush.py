"""The put path keeps unflushed bytes within the disk reserve (diskroom.py) without
making writers queue behind a flush, and a get's byte bound (getbound.py) keeps the
one-call read for a usual batch."""
import os
import threading
import time

from cacheserver import store as store_mod
from cacheserver.counters import Counters
from cacheserver.diskroom import MARGIN
from cacheserver.eviction import LRUPolicy
from cacheserver.getbound import GROUP, bounded_get
from cacheserver.store import Store

SLOW_FLUSH_S = 1.0
_REAL_SIZE_LSM = store_mod.size_lsm
_REAL_LARGE = store_mod.large_values_options


def _big_memtable(opts, capacity):
    """The LSM sized for the capacity (diskbudget.py), but with RocksDB's 64 MiB memtable:
    one that holds more than half the reserve before RocksDB flushes it by itself."""
    _REAL_SIZE_LSM(opts, capacity)
    opts.set_write_buffer_size(64 << 20)


def _big_memtable_large(capacity):
    opts = _REAL_LARGE(capacity)  # the family of large values (blob files), likewise
    opts.set_write_buffer_size(64 << 20)
    return opts


def _slow_flush_store(path, monkeypatch):
    monkeypatch.setattr(store_mod, "size_lsm", _big_memtable)
    monkeypatch.setattr(store_mod, "large_values_options", _big_memtable_large)
    s = Store(path, 1 << 30, LRUPolicy(), Counters(), durability="process")
    real, flushes = s.flush, []

    def slow():
        flushes.append(threading.current_thread().name)
        time.sleep(SLOW_FLUSH_S)
        real()
    s.flush = slow
    return s, flushes


def test_put_past_half_the_reserve_flushes_in_the_background(tmp_path, monkeypatch):
    s, flushes = _slow_flush_store(str(tmp_path / "s"), monkeypatch)
    try:
        chunk = s.room.reserve // 8
        waited = []
        for i in range(6):  # up to 3/4 of the reserve: past half, short of the whole
            item = (os.urandom(32), os.urandom(chunk))
            t0 = time.monotonic()
            s.put_many([item])
            waited.append(time.monotonic() - t0)
        assert flushes == ["store-room-flush"]  # one flush, not one per put, and not in a put's thread
        assert max(waited) < SLOW_FLUSH_S  # no put waited for it
        s.admit._room_flush.acquire(timeout=10)  # the background flush ends
        s.admit._room_flush.release()
        assert s._unflushed_bytes() < s.room.reserve // 2
    finally:
        s.close()


def test_put_that_would_pass_the_reserve_waits_for_the_flush(tmp_path, monkeypatch):
    s, flushes = _slow_flush_store(str(tmp_path / "s"), monkeypatch)
    try:
        chunk = s.room.reserve // 4
        for _ in range(5):  # the last ones cannot be taken on top of what is unflushed
            s.put_many([(os.urandom(32), os.urandom(chunk))])
            assert s._unflushed_bytes() + MARGIN <= s.room.reserve  # what the reserve can flush
        assert flushes and s.counters.snapshot().get("flushes", 0) >= 1
    finally:
        s.close()


def test_bounded_get_small_batch_is_one_store_call_and_still_bounded():
    vals = {bytes([i]) * 32: memoryview(bytes(100)) for i in range(4)}
    calls = []

    def get_many(ks):
        calls.append(list(ks))
        return [vals.get(k) for k in ks]
    ids = list(vals) + [list(vals)[0]] * 4 + [b"\xff" * 32]
    out, cut = bounded_get(get_many, ids, 10_000)
    assert len(calls) == 1 and cut == 0 and [v is not None for v in out] == [True] * 8 + [False]
    calls.clear()
    out, cut = bounded_get(get_many, ids, 450)  # four values fit, the other four hits are cut
    assert [v is not None for v in out] == [True] * 4 + [False] * 5 and cut == 4
    big = [list(vals)[0]] * (GROUP * 3)
    out, cut = bounded_get(get_many, big, 1000)  # past one group: each distinct id read once
    assert sum(v is not None for v in out) == 10 and cut == GROUP * 3 - 10
