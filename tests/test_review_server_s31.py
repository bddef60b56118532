"""Review of the server's delete and evict paths under write stops (cacheserver/storeevict.py,
store.py, storerecovery.py, the EvictChunk/EvictDataset handlers):

* EvictChunk and EvictDataset (the manager's calls) deleted the chunk's records under the store's
  lock, waiting out a write stop (up to STUCK_S) inside the call, and the chunk table's save before
  it (keep_state) waited one out as well: the manager's call ran past its timeout and failed
  (INTERNAL), and every put and adopt waited for the store's lock meanwhile. Now the ids are misses
  at once and their deletes are left for once writes go again, as a stranded delete's.
* An id whose records a stop stranded (evicted, dropped) and that was put again with a value of the
  other size class (a small one after a large one, or the reverse) kept its old copy in the other
  column family until the next flush deleted it: a close or a kill before that flush (a close
  during a stop flushes nothing) left the copy on disk for good, counted by no one (not in `used`
  nor `blob_bytes`; a salvage keeps it too, the id being indexed). Now the put's own logged batch
  deletes every old copy of a stranded id.

Writes are stopped for real, as test_review_write_stop.py does (level 0 past its stop trigger, no
compaction due: nothing RocksDB does ends the stop); the tests only choose when it begins."""
import os
import threading
import time

import pytest

from cacheserver import stallwrite
from cacheserver.client.server_client import ServerClient
from cacheserver.counters import Counters
from cacheserver.diskbudget import BLOB_MIN
from cacheserver.eviction import LRUPolicy
from cacheserver.server import CacheServer, ServerConfig
from cacheserver.store import OVERHEAD, Store
from procs import wait_until
from test_review_store2_s29 import every_record_counted
from test_review_store_s29 import level0_files
from test_review_write_stop import GO, STOP

SMALL = 1000
GIVE_UP_S = 3.0  # STUCK_S here: a call that waits a stop out is plain to see


@pytest.fixture
def slow_give_up(monkeypatch):
    monkeypatch.setattr(stallwrite, "STUCK_S", GIVE_UP_S)


@pytest.fixture
def server(tmp_path, slow_give_up):
    srv = CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir=str(tmp_path / "d"), capacity=64 << 20))
    srv.start()
    srv.store._flusher.stop()  # flushes only where the test makes them
    yield srv
    srv.stop(grace=0)


def timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return time.monotonic() - t0, out


def gone_from_disk(s: Store, keys: list[bytes]) -> bool:
    return all(s._raw(k) is None and s._meta.get(k) is None for k in keys)


@pytest.mark.parametrize("call", ["EvictChunk", "EvictDataset"])
def test_the_manager_s_eviction_during_a_write_stop_answers_at_once(server, call):
    s = server.store
    c = ServerClient(server.address, timeout=2.0, use_dataplane=False)  # the manager's timeout (Actuator)
    try:
        chunk = [(os.urandom(32), os.urandom(SMALL)) for _ in range(5)]
        kept = (os.urandom(32), os.urandom(SMALL))
        assert c.put(chunk, dataset="ds", chunk=0) == (5, 0, 0)
        assert c.put([kept], dataset="other", chunk=0) == (1, 0, 0)
        c.ref_chunk("ds", 0, "job")  # its reference goes with the eviction: the chunk table is saved
        c.active_chunk("ds", 0)
        level0_files(s, 4)
        s._db.set_options(STOP)
        assert s._db.property_int_value("rocksdb.is-write-stopped") == 1
        evict = (lambda: c.evict_chunk("ds", 0, force=True)) if call == "EvictChunk" else (lambda: c.evict_dataset("ds"))
        answer: list = []

        def manager():
            try:
                answer.append(timed(evict))
            except Exception as e:  # the call's deadline, or the wait's WriteStopped as INTERNAL
                answer.append(e)
        th = threading.Thread(target=manager, daemon=True)
        th.start()
        time.sleep(0.3)
        took, _ = timed(s.adopt, [kept[0]], ("other", 1))  # takes the store's lock
        th.join(GIVE_UP_S * 3)
        assert answer and not isinstance(answer[0], Exception), (answer, f"an adopt meanwhile took {took:.1f} s")
        assert answer[0][0] < 1.0, f"{call} waited {answer[0][0]:.1f} s for the write stop"
        assert answer[0][1] == (5, 5 * (SMALL + OVERHEAD))
        assert took < 1.0, f"an adopt waited {took:.1f} s for the store's lock"
        keys = [k for k, _ in chunk]
        assert s.get_many(keys) == [None] * 5 and s.contains(keys) == bytes(5)  # misses at once
        assert ("ds", 0) not in {(ch.dataset, ch.chunk) for ch in c.stats().chunks}
        assert not gone_from_disk(s, keys)  # still there: writes are stopped
        s._db.set_options(GO)
        assert s.flush()  # writes go again: the first flush deletes them
        assert gone_from_disk(s, keys) and not s._stranded
        assert s.get_many(keys) == [None] * 5
    finally:
        c.close()


def test_an_eviction_s_deletes_left_by_a_stop_go_by_the_flusher_alone(tmp_path):
    """No put follows the eviction: the flusher, which flushes only what puts made dirty, still
    deletes what the stop left once writes go again."""
    s = Store(str(tmp_path / "s"), 1 << 30, LRUPolicy(), Counters())
    try:
        keys = [os.urandom(32) for _ in range(3)]
        assert s.put_many([(k, os.urandom(SMALL)) for k in keys], ("ds", 0)) == (3, 0, 0)
        level0_files(s, 4)
        wait_until(lambda: s._dirty_state()[0] is None, "nothing dirty (all put was flushed)")
        s._db.set_options(STOP)
        s.evict_tags(lambda t: t == ("ds", 0))
        assert set(s._stranded) == set(keys)
        s._db.set_options(GO)
        wait_until(lambda: not s._stranded, "the flusher's delete of what the stop left")  # ticks every 0.1 s
        assert gone_from_disk(s, keys)
    finally:
        s.close()


def held_sizes(s: Store) -> tuple[int, int]:
    return sum(c for c, _ in s._index.values()), sum(c for c, _ in s._index.values() if c >= BLOB_MIN + OVERHEAD)


def record_bytes(s: Store) -> int:
    """The bytes of every value record RocksDB holds live, in both families (a charge is its
    value's length + OVERHEAD: more than its record, the value and an 8-byte trailer)."""
    return sum(len(v) for family in (s._db, s._large) for v in family.values())


@pytest.mark.parametrize("gone, back", [(BLOB_MIN, SMALL), (SMALL, BLOB_MIN)], ids=["large-then-small",
                                                                                  "small-then-large"])
@pytest.mark.parametrize("stranded_by", ["evict_tags", "put"])
@pytest.mark.parametrize("durability", ["process", "cache"])
def test_a_close_during_a_stop_leaves_no_old_copy_of_an_id_put_again(tmp_path, monkeypatch, gone, back,
                                                                    stranded_by, durability):
    """The stop strands the id's delete; writes go, the id is put again in the other size class;
    a stop again, and the store closes (its last flush skipped for the stop): after the restart
    every record on disk is an indexed entry's and the store's counts are its entries'."""
    monkeypatch.setattr(stallwrite, "STUCK_S", 0.3)
    path = str(tmp_path / "s")
    capacity = max(gone, back) + OVERHEAD + 5 * (SMALL + OVERHEAD)
    s = Store(path, capacity, LRUPolicy(), Counters(), durability=durability)
    if s._flusher is not None:
        s._flusher.stop()
    key, tag = os.urandom(32), ("ds", 0)
    s._db.set_options({"disable_auto_compactions": "true"})
    assert s.put_many([(key, os.urandom(gone))], tag) == (1, 0, 0)  # the least recent entry
    s.flush()
    level0_files(s, 4)
    s._db.set_options(STOP)
    if stranded_by == "put":  # a put that must evict it, its delete ended by the stop
        with pytest.raises(stallwrite.WriteStopped):
            s.put_many([(os.urandom(32), os.urandom(s.capacity - s.used - OVERHEAD + 1))])
    else:
        try:
            s.evict_tags(lambda t: t == tag)
        except stallwrite.WriteStopped:
            pass  # the eviction's own wait gave up (before the fix)
    assert key not in s._index and key in s._stranded
    s._db.set_options(GO)
    value = os.urandom(back)
    assert s.put_many([(key, value)]) == (1, 0, 0)
    if durability == "cache":
        s._db.flush()  # its value in a table file (RocksDB's own flush: no stranded delete with it)
        s._large.flush()
    s._db.set_options(STOP)  # 4+ files in level 0: stopped again
    assert s._db.property_int_value("rocksdb.is-write-stopped") == 1
    s.close()
    again = Store(path, capacity, LRUPolicy(), Counters(), durability=durability)
    try:
        assert [bytes(v) for v in again.get_many([key])] == [value]
        every_record_counted(again)  # the old copy stayed in the other family, counted by no one
        assert (again.used, again.blob_bytes) == held_sizes(again)
        assert record_bytes(again) <= again.used  # the live records' bytes on disk, within the count
    finally:
        again.close()
