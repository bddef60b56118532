"""Review of closing a store whose RocksDB failed a write (cacheserver/storeflush.py, store.py):

* close() of a failed store left RocksDB open in this process (a column family's close raised
  before the handles went, so RocksDB's LOCK stayed held): the embedded cache, which retries by
  reopening the same directory, was refused for as long as the process lived. It now releases
  RocksDB whatever its flushes answer, and says what was lost.
* A RocksDB error deleting records (an eviction, a dropped corrupt record) did not mark the
  store failed: puts went on failing one by one with RocksDB's error, and close() raised,
  keeping the data dir's lock and RocksDB's.

A RocksDB error is a real one: an append past the process's file size limit (EFBIG), as a full
disk fails it."""
import contextlib
import logging
import os
import resource
import signal
from collections.abc import Iterator

import pytest

from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import Store
from clients.embedded import EmbeddedCache
from test_review_store_failures import assert_counted, ids

CAPACITY = 1 << 30


@contextlib.contextmanager
def past_file_limit(s: Store) -> Iterator[None]:
    """Every file of this process limited to the size of the store's log now: its next append
    fails in RocksDB (an I/O error). Restored on the way out."""
    wal = max(os.path.getsize(os.path.join(s.db_path, f)) for f in os.listdir(s.db_path) if f.endswith(".log"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG, the process lives
    resource.setrlimit(resource.RLIMIT_FSIZE, (wal, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def fail_a_put(s: Store) -> None:
    with past_file_limit(s), pytest.raises(Exception, match="IO error"):
        s.put_many([(k, b"f" * 1000) for k in ids(20)])
    assert s.room.state == "failed"


def close_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("closing the store")]


@pytest.mark.parametrize("durability", ["cache", "process"])
def test_a_failed_store_closes_releasing_rocksdb_and_says_what_was_lost(tmp_path, caplog, durability):
    path = str(tmp_path / "s")
    s = Store(path, CAPACITY, LRUPolicy(), Counters(), durability=durability)
    flushed, late = ids(4), ids(3)
    assert s.put_many([(k, b"a" * 1000) for k in flushed]) == (4, 0, 0)
    s.flush()
    assert s.put_many([(k, b"b" * 1000) for k in late]) == (3, 0, 0)  # acknowledged, in no table file yet
    fail_a_put(s)
    caplog.set_level(logging.WARNING, logger="cacheserver")
    s.close()
    again = Store(path, CAPACITY, LRUPolicy(), Counters(), durability=durability)  # refused: "lock hold by current process"
    try:
        said = close_messages(caplog)
        assert len(said) == 1, said
        if durability == "cache":  # values skip the log: those not flushed die with the failed flush
            assert "3 values" in said[0] and "misses" in said[0], said
        else:
            assert "nothing acknowledged is lost" in said[0], said
        assert [bytes(v) for v in again.get_many(flushed)] == [b"a" * 1000] * 4
        got = again.get_many(late)
        if durability == "cache":
            assert got == [None] * 3 and again.counters["recovered_unflushed_dropped"] == 3
        else:
            assert [bytes(v) for v in got] == [b"b" * 1000] * 3
        assert again.put_many([(k, b"n" * 1000) for k in ids(2)]) == (2, 0, 0)  # and it writes again
        assert_counted(again)
    finally:
        again.close()


def test_the_embedded_cache_reopens_after_its_store_failed(tmp_path):
    cache_dir = str(tmp_path / "emb")
    cache = EmbeddedCache.shared(cache_dir, 64 << 20)
    key = os.urandom(32)
    try:
        assert cache.server.store.put_many([(key, b"kept")]) == (1, 0, 0)
        cache.server.store.flush()
        fail_a_put(cache.server.store)
    finally:
        cache.release()  # raised nothing before either, but RocksDB stayed open in this process
    cache = EmbeddedCache.shared(cache_dir, 64 << 20)  # raised StoreUnopenable: "this process has it open"
    try:
        assert bytes(cache.server.store.get_many([key])[0]) == b"kept"
        assert cache.server.store.room.state == "ok"
    finally:
        cache.release()


@pytest.mark.parametrize("delete", ["evict_tags", "drop_corrupt"])
def test_a_rocksdb_error_deleting_fails_the_store_and_its_close_releases_it(tmp_path, caplog, delete):
    path = str(tmp_path / "s")
    s = Store(path, CAPACITY, LRUPolicy(), Counters(), durability="process")
    keys = ids(6)
    assert s.put_many([(k, b"d" * 1000) for k in keys], ("ds", 1)) == (6, 0, 0)
    s.flush()
    if delete == "drop_corrupt":
        s._db.put(keys[0], b"damaged: no trailer")  # as a failing disk would leave it
    with past_file_limit(s):
        if delete == "evict_tags":
            with pytest.raises(Exception, match="IO error"):
                s.evict_tags(lambda tag: tag == ("ds", 1))
        else:  # a get that finds a damaged record deletes it, and answers a miss all the same
            assert s.get_many(keys[:1]) == [None]
    assert s.room.state == "failed", "a RocksDB error deleting left the store taking puts"
    assert s.put_many([(os.urandom(32), b"p" * 1000)]) == (0, 0, 1)  # refused, with the reason, not tried
    caplog.set_level(logging.WARNING, logger="cacheserver")
    s.close()  # raised RocksDB's error, keeping its LOCK and the data dir's
    assert len(close_messages(caplog)) == 1
    again = Store(path, CAPACITY, LRUPolicy(), Counters(), durability="process")
    try:
        # the deletes never reached the disk: evicted records are held again, counted; the
        # damaged one's delete was owed (owed-deletes): the restart drops it
        assert again.items == (5 if delete == "drop_corrupt" else 6)
        assert [bytes(v) for v in again.get_many(keys[1:])] == [b"d" * 1000] * 5
        assert_counted(again)
    finally:
        again.close()
