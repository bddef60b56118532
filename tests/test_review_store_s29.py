"""Review of the store's flushes and close (cacheserver/storeflush.py, core.open_follower):

* flush_for_followers answered True for a flush that was skipped or failed (writes stopped, a
  failed store): core.open_follower counted a `follower_flushes` and began its
  FOLLOWER_FLUSH_INTERVAL back-off, so an open right after the stop was not flushed for, and
  replayed the whole log.
* A flush whose table files were written but whose durable mark a write stop kept off the disk
  (the flush's own file took level 0 to its stop trigger) raised WriteStopped: out of close(),
  before RocksDB and the data dir were released (the embedded cache's reopen of the same dir
  was refused as "in use"), and out of OPEN_FOLLOWER as an internal error (a client then gives
  its follower up for good).

Writes are stopped for real, as test_review_write_stop.py does (level 0 at its stop trigger,
no compaction due); a RocksDB error is a real one, a log append past the process's file size
limit (test_review_store_close_failed.py)."""
import logging
import os

import pytest

from cacheserver import stallwrite
from cacheserver.core import CacheCore
from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import Store
from cacheserver.storeflush import FOLLOWER_FLUSH_MIN_BYTES
from test_review_store_close_failed import fail_a_put
from test_review_write_stop import GO, STOP, durable_mark

CAPACITY = 1 << 30
STOPPED = "rocksdb.is-write-stopped"


@pytest.fixture(autouse=True)
def quick_give_up(monkeypatch):
    monkeypatch.setattr(stallwrite, "STUCK_S", 0.3)


def values(n: int, size: int = 64 << 10) -> list[tuple[bytes, bytes]]:
    return [(os.urandom(32), os.urandom(size)) for _ in range(n)]


def level0_files(s: Store, n: int) -> None:
    """``n`` table files in level 0, none compacted."""
    s._db.set_options({"disable_auto_compactions": "true"})
    for _ in range(n):
        assert s.put_many(values(1, 1000)) == (1, 0, 0)
        s.flush()


def past_the_follower_minimum(s: Store) -> list[tuple[bytes, bytes]]:
    """Values enough in the memtables for OPEN_FOLLOWER to flush them."""
    put = values(FOLLOWER_FLUSH_MIN_BYTES // (64 << 10) + 8)
    assert s.put_many(put) == (len(put), 0, 0)
    assert s._unflushed_bytes() >= FOLLOWER_FLUSH_MIN_BYTES
    return put


@pytest.mark.parametrize("why", ["write stop", "failed store"])
def test_a_follower_flush_not_made_is_neither_counted_nor_backed_off(tmp_path, why):
    # durability "process": no flusher thread, so the memtables hold what was put until asked
    s = Store(str(tmp_path / "s"), CAPACITY, LRUPolicy(), Counters(), durability="process")
    core = CacheCore(s, s.counters)
    try:
        if why == "write stop":
            level0_files(s, 4)
            past_the_follower_minimum(s)
            s._db.set_options(STOP)  # 4 files at a stop trigger of 3: a flush would wait for ever
            assert s._db.property_int_value(STOPPED) == 1
        else:
            past_the_follower_minimum(s)
            fail_a_put(s)
        flushes = s.counters["flushes"]
        assert not core.open_follower()  # answered True: "flushed"
        assert s.counters["follower_flushes"] == 0 and s.counters["flushes"] == flushes
        assert s._unflushed_bytes() >= FOLLOWER_FLUSH_MIN_BYTES  # the log as long as it was
        if why == "write stop":
            s._db.set_options(GO)
            assert core.open_follower()  # False: a back-off begun for the flush never made
            assert s.counters["follower_flushes"] == 1 and s._unflushed_bytes() < FOLLOWER_FLUSH_MIN_BYTES
    finally:
        s.close()


def stop_at_the_next_flush(s: Store) -> None:
    """Two files in level 0 and a stop trigger of 3: the next flush's own file stops writes,
    after its table files are written and before its durable mark is (durability "cache")."""
    s._flusher.stop()  # no background flush races the test's (it would meet the stop first)
    level0_files(s, 2)
    s._db.set_options(STOP)
    assert s._db.property_int_value(STOPPED) == 0


def test_close_releases_the_store_when_its_last_flush_s_mark_meets_a_write_stop(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="cacheserver")
    path = str(tmp_path / "s")
    s = Store(path, CAPACITY, LRUPolicy(), Counters())
    stop_at_the_next_flush(s)
    late = values(3)
    assert s.put_many(late) == (3, 0, 0)  # acknowledged, in the memtable only
    s.close()  # raised WriteStopped, RocksDB's LOCK and the data dir's still held
    assert any("writing its durable mark" in r.getMessage() for r in caplog.records), "the mark did not fail"
    again = Store(path, CAPACITY, LRUPolicy(), Counters())  # refused: DataDirBusy ("in use")
    try:
        # the last flush wrote them: the older mark has them checked at start, and found
        assert [bytes(v) for v in again.get_many([k for k, _ in late])] == [v for _, v in late]
        assert again.items == 5 and again.counters["recovered_unflushed_dropped"] == 0
    finally:
        again.close()


def test_open_follower_answers_when_its_flush_s_mark_meets_a_write_stop(tmp_path):
    s = Store(str(tmp_path / "s"), CAPACITY, LRUPolicy(), Counters())
    core = CacheCore(s, s.counters)
    try:
        stop_at_the_next_flush(s)
        put = past_the_follower_minimum(s)
        mark = durable_mark(s)
        assert core.open_follower()  # raised WriteStopped: an internal error to the client
        assert s._db.property_int_value(STOPPED) == 1 and durable_mark(s) == mark  # as set up
        # flushed: followers see the values; the mark is owed to the next flush
        assert s.counters["follower_flushes"] == 1 and s.touch_split([k for k, _ in put])[1] == []
        assert s._dirty_state()[0] is not None
        s._db.set_options(GO)
        s.flush()
        assert durable_mark(s) == s._seq
    finally:
        s.close()
