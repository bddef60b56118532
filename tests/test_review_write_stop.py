"""Review of the store's give-up on a write stop nothing ends (cacheserver/stallwrite.py).

* A put a write stop ended holds nothing back once writes go again: the values put after it
  are flushed as any others (durable mark, the unflushed set same-host followers go by).
* Index records a stop left without their values are deleted once writes go again, not
  indexed by a restart nor holding the durable mark for good.
* A server answers such a put as the refused puts after it, not as an internal error that
  makes clients take the whole server (its reads too) as down.

Writes are stopped for real, as test_review_space.py does: level 0 past its stop trigger with
no compaction due, so that nothing RocksDB does ends the stop."""
import os
import struct

import pytest

from cacheserver import stallwrite
from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import Store
from cacheserver.storerecovery import DURABLE_MARK_KEY

STOP = {"level0_file_num_compaction_trigger": "100", "level0_slowdown_writes_trigger": "3",
        "level0_stop_writes_trigger": "3", "disable_auto_compactions": "false"}
GO = {"level0_slowdown_writes_trigger": "100", "level0_stop_writes_trigger": "100"}


@pytest.fixture(autouse=True)
def quick_give_up(monkeypatch):
    monkeypatch.setattr(stallwrite, "STUCK_S", 0.3)


def stop_writes(s: Store) -> None:
    """4 table files in level 0, then a stop trigger of 3 and compactions due at 100."""
    db = s._db
    db.set_options({"disable_auto_compactions": "true"})
    for _ in range(4):
        s.put_many([(os.urandom(32), b"v" * 1000)])
        s.flush()
    db.set_options(STOP)
    assert db.property_int_value("rocksdb.is-write-stopped") == 1


def durable_mark(s: Store) -> int:
    return struct.unpack("<Q", s._server.get(DURABLE_MARK_KEY))[0]


def test_values_put_after_a_stopped_put_are_flushed_as_any(tmp_path):
    """The stopped put's sequence stayed among the puts being written for good: every later
    flush took it as its mark, so the durable mark never moved again (a restart re-read every
    value written since), and the values put since stayed 'unflushed' for ever (a growing set
    rebuilt at each flush; same-host followers were sent to the socket for all of them)."""
    s = Store(str(tmp_path / "s"), 1 << 30, LRUPolicy(), Counters())
    try:
        stop_writes(s)
        with pytest.raises(stallwrite.WriteStopped):
            s.put_many([(os.urandom(32), b"n" * 1000)])
        s._db.set_options(GO)
        keys = [os.urandom(32) for _ in range(50)]
        assert s.put_many([(k, b"a" * 1000) for k in keys]) == (50, 0, 0)
        s.flush()
        assert s.touch_split(keys)[1] == [] and not s._unflushed
        assert durable_mark(s) == s._seq
    finally:
        s.close()


def test_index_records_a_stop_left_without_values_go_once_writes_do(tmp_path):
    """A stop that began between a put's two writes (its index records logged, its values
    not): the records are deleted at the next flush once writes go again; a restart neither
    indexes them nor has to check every value written since."""
    path = str(tmp_path / "s")
    s = Store(path, 1 << 30, LRUPolicy(), Counters())
    values = s._unlogged

    def stopped_values(build):  # the real stop, reached only by the values' write
        s._db.set_options(STOP)
        values(build)
    s._db.set_options({"disable_auto_compactions": "true"})
    for _ in range(4):
        s.put_many([(os.urandom(32), b"v" * 1000)])
        s.flush()
    s._unlogged = stopped_values
    lost = [os.urandom(32) for _ in range(3)]
    with pytest.raises(stallwrite.WriteStopped):
        s.put_many([(k, b"x" * 1000) for k in lost])
    s._unlogged = values
    assert all(s._meta.get(k) is not None for k in lost)  # in without their values
    s._db.set_options(GO)
    kept = [os.urandom(32) for _ in range(5)]
    assert s.put_many([(k, b"k" * 1000) for k in kept] + [(lost[0], b"y" * 1000)]) == (6, 0, 0)
    s.flush()
    assert all(s._meta.get(k) is None for k in lost[1:]) and durable_mark(s) == s._seq
    held = s.items
    s.close()
    again = Store(path, 1 << 30, LRUPolicy(), Counters())
    try:
        assert again.items == held and again.counters["recovered_unflushed_dropped"] == 0
        assert [bytes(v) for v in again.get_many(kept + lost[:1])] == [b"k" * 1000] * 5 + [b"y" * 1000]
        assert again.get_many(lost[1:]) == [None, None] and again.counters["corrupt_dropped"] == 0
    finally:
        again.close()


def test_values_evicted_for_a_put_a_stop_ended_leave_the_disk_once_writes_go(tmp_path):
    """The put had to evict, and the stop ended the eviction's delete: its victims had left
    the index (and the accounting) but stayed on disk, unaccounted, until a restart indexed
    them again."""
    from cacheserver.store import OVERHEAD

    path = str(tmp_path / "s")
    s = Store(path, 8 * (1000 + OVERHEAD), LRUPolicy(), Counters())
    s._db.set_options({"disable_auto_compactions": "true"})
    ks = [os.urandom(32) for _ in range(8)]
    for i in range(0, 8, 2):  # full, and 4 table files in level 0
        s.put_many([(k, b"v" * 1000) for k in ks[i:i + 2]])
        s.flush()
    s._db.set_options(STOP)
    with pytest.raises(stallwrite.WriteStopped):
        s.put_many([(os.urandom(32), b"n" * 1000)])  # must evict one
    victims = [k for k in ks if k not in s._index]
    assert len(victims) == 1
    s._db.set_options(GO)
    s.put_many([(os.urandom(32), b"a" * 1000)])
    s.flush()
    assert s._raw(victims[0]) is None
    s.close()
    again = Store(path, 8 * (1000 + OVERHEAD), LRUPolicy(), Counters())
    try:
        assert victims[0] not in again._index and again.counters["recovered_items"] == 8
    finally:
        again.close()


def test_a_put_a_stop_ended_is_refused_and_the_server_stays_up(tmp_path):
    """The put that gave up came back as INTERNAL (gRPC: UNKNOWN) with a traceback in the
    server's log: clients took the server as failed and read none of its values for their
    back-off, though the store serves reads all along."""
    from cacheserver.client.ring_client import RingClient
    from cacheserver.server import CacheServer, ServerConfig

    srv = CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir=str(tmp_path / "d"), capacity=64 << 20))
    srv.start()
    try:
        with RingClient([srv.address]) as ring:
            held = os.urandom(32)
            assert ring.put([(held, b"h" * 1000)]) == 1
            stop_writes(srv.store)
            assert ring.put([(os.urandom(32), b"n" * 1000)]) == 0
            assert srv.counters["rejected_disk_full"] == 1
            assert [bytes(v) for v in ring.get([held])] == [b"h" * 1000]  # not taken as down
            assert ring.errors == 0
    finally:
        srv.stop(grace=0)
