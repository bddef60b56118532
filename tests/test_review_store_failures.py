"""Review of the store's failures (cacheserver/store.py, chunkrefs.py, storerecovery.py):

* Derived state that cannot be read (the saved chunk table, the durable mark) is dropped with one
  warning and the store starts; it stopped the store, and the server, from starting at all.
* An error inside a put that is not RocksDB's (out of memory building its batch) fails that put
  alone: it marked the store failed, every later put refused until a restart.
* A replace that a write stop (stallwrite.py) or another error cuts short before anything of it
  reached the disk leaves the records it would have replaced indexed and counted: they were on
  disk, out of the index and the byte accounting, until a restart indexed them again.

Writes are stopped for real, as test_review_write_stop.py does: level 0 past its stop trigger
with no compaction due, so that nothing RocksDB does ends the stop."""
import logging
import os
import signal

import pytest

from cacheserver import stallwrite
from cacheserver import store as store_module
from cacheserver.chunkrefs import STATE_KEY
from cacheserver.client.server_client import ServerClient
from cacheserver.core import CacheCore
from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import OVERHEAD, Store
from cacheserver.storerecovery import _META, DURABLE_MARK_KEY
from procs import cacheserver
from test_review_store_reopen import raw_store, set_server_state
from test_review_write_stop import GO, STOP

SLOT = 1000 + OVERHEAD


@pytest.fixture(autouse=True)
def quick_give_up(monkeypatch):
    monkeypatch.setattr(stallwrite, "STUCK_S", 0.3)


def ids(n):
    return [os.urandom(32) for _ in range(n)]


def on_disk(s: Store) -> dict[bytes, int]:
    """id -> charge of every record on disk with both its index record and its value."""
    return {k: _META.unpack_from(meta)[0] + OVERHEAD for k, meta in s._meta.items() if s._raw(k) is not None}


def assert_counted(s: Store) -> None:
    """The index and the byte accounting are what is on disk."""
    disk = on_disk(s)
    assert set(s._index) == set(disk), "records on disk and the index differ"
    assert s.used == sum(disk.values())


def dropped_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "chunk table" in r.getMessage() and r.levelno == logging.WARNING]


# ---- 1. derived state that cannot be read ------------------------------------------------

CORRUPT_TABLES = {
    "not-json": b"{not json",
    "not-utf8": b"\xff\xfe\x00\x01",
    "not-an-object": b"[1, 2]",
    "bad-active": b'{"active": {"ds": "three"}, "refs": []}',
    "short-ref": b'{"active": {}, "refs": [["ds", 1]]}',
    "jobs-not-a-list": b'{"active": {}, "refs": [["ds", 1, "job"]]}',  # was read as jobs j, o, b
    "negative-chunk": b'{"active": {"ds": -4}, "refs": []}',
}


@pytest.mark.parametrize("raw", CORRUPT_TABLES.values(), ids=CORRUPT_TABLES.keys())
def test_a_corrupt_chunk_table_is_dropped_with_one_warning_and_nothing_else(tmp_path, caplog, raw):
    path = str(tmp_path / "s")
    s = Store(path, 1 << 30, LRUPolicy(), Counters())
    keys = ids(3)
    s.put_many([(k, b"v" * 1000) for k in keys], ("ds", 1))
    s.put_state(STATE_KEY, raw)
    s.close()
    caplog.set_level(logging.WARNING, logger="cacheserver")
    for attempt in range(2):
        s = Store(path, 1 << 30, LRUPolicy(), Counters())  # raised here before
        try:
            core = CacheCore(s, s.counters)
            assert core.chunks.active == {} and core.chunks.refs == {}
            assert [bytes(v) for v in s.get_many(keys)] == [b"v" * 1000] * 3  # nothing else lost
            core.chunks.set_active("ds", 2)  # and the table works again
            assert core.chunks.active == {"ds": 2}
        finally:
            s.close()
        warned = dropped_warnings(caplog)
        assert len(warned) == 1, warned  # once: the emptied table is saved over the corrupt one
        assert f"'{STATE_KEY}'" in warned[0] and f"{len(raw)} bytes" in warned[0]
        if attempt == 0:
            s2 = Store(path, 1 << 30, LRUPolicy(), Counters())
            assert s2.get_state(STATE_KEY) != raw
            s2.put_state(STATE_KEY, raw)  # corrupt again for the second round: a second warning
            s2.close()
            caplog.clear()


def test_a_valid_chunk_table_still_survives_a_restart(tmp_path, caplog):
    path = str(tmp_path / "s")
    s = Store(path, 1 << 30, LRUPolicy(), Counters())
    core = CacheCore(s, s.counters)
    core.chunks.set_active("ds", 3)
    core.chunks.ref("ds", 2, "job-a")
    s.close()
    caplog.set_level(logging.WARNING, logger="cacheserver")
    s = Store(path, 1 << 30, LRUPolicy(), Counters())
    try:
        core = CacheCore(s, s.counters)
        assert core.chunks.active == {"ds": 3} and core.chunks.refs == {("ds", 2): {"job-a"}}
        assert core.chunks.is_protected(("ds", 2)) and not dropped_warnings(caplog)
    finally:
        s.close()


def test_a_server_starts_over_a_corrupt_chunk_table_and_keeps_its_items(tmp_path):
    data = str(tmp_path / "d")
    keys = ids(4)
    srv = cacheserver(data, "64MB").start()
    try:
        with ServerClient(srv.address) as c:
            assert c.put([(k, b"x" * 2000) for k in keys], dataset="ds", chunk=0)[0] == 4
            c.active_chunk("ds", 0)
            c.ref_chunk("ds", 0, "job-a")
    finally:
        assert srv.stop() == 0
    s = Store(data, 64 << 20, LRUPolicy(), Counters())
    s.put_state(STATE_KEY, b'{"active": {"ds": 0}, "refs": [["ds", 0, ')  # cut short
    s.close()
    srv = cacheserver(data, "64MB").start()  # did not become ready: a traceback of json.loads
    try:
        with ServerClient(srv.address) as c:
            assert [bytes(v) for v in c.get(keys)] == [b"x" * 2000] * 4
            assert dict(c.stats().active_chunks) == {}
        os.kill(srv.pid, signal.SIGKILL)  # the emptied table was saved, logged: no second warning
        srv.proc.wait(10)
    finally:
        srv.kill()
    srv = cacheserver(data, "64MB").start()
    try:
        with ServerClient(srv.address) as c:
            assert [bytes(v) for v in c.get(keys)] == [b"x" * 2000] * 4
    finally:
        assert srv.stop() == 0
    with open(srv.log_path) as f:
        warned = [line for line in f if "dropped the saved chunk table" in line]
    assert len(warned) == 1, warned


def test_a_corrupt_durable_mark_is_dropped_and_every_entry_checked(tmp_path, caplog):
    path = str(tmp_path / "s")
    s = Store(path, 1 << 30, LRUPolicy(), Counters())
    keys = ids(5)
    s.put_many([(k, b"m" * 1000) for k in keys])
    s.close()
    db_path = os.path.join(path, "db")
    set_server_state(db_path, DURABLE_MARK_KEY, b"\x01\x02\x03")  # not the 8 bytes of a sequence
    with raw_store(db_path) as db:
        del db[keys[0]]  # a value lost without its index record: only a full check finds it
    caplog.set_level(logging.WARNING, logger="cacheserver")
    s = Store(path, 1 << 30, LRUPolicy(), Counters())  # raised struct.error here before
    try:
        assert s.items == 4 and s.counters["recovered_unflushed_dropped"] == 1
        assert [bytes(v) for v in s.get_many(keys[1:])] == [b"m" * 1000] * 4
        assert any("durable mark" in r.getMessage() for r in caplog.records)
        assert_counted(s)
    finally:
        s.close()


# ---- 2. an error of a put that is not RocksDB's --------------------------------------------

def fail_next_record(monkeypatch, exc: BaseException) -> None:
    """The next value record a put builds raises ``exc`` (as a batch build out of memory)."""
    real, calls = store_module.wrap, []

    def wrap(value):
        calls.append(1)
        if len(calls) == 1:
            raise exc
        return real(value)
    monkeypatch.setattr(store_module, "wrap", wrap)


@pytest.mark.parametrize("durability", ["cache", "process"])
def test_an_error_building_a_put_fails_that_put_not_the_store(tmp_path, monkeypatch, durability):
    path = str(tmp_path / "s")
    s = Store(path, 1 << 30, LRUPolicy(), Counters(), durability=durability)
    held, failed, later = ids(3), ids(2), ids(2)
    try:
        assert s.put_many([(k, b"h" * 1000) for k in held]) == (3, 0, 0)
        fail_next_record(monkeypatch, MemoryError("out of memory (injected)"))
        with pytest.raises(MemoryError):
            s.put_many([(k, b"f" * 1000) for k in failed])
        assert s.room.state == "ok", s.room._why  # was "failed": puts refused until a restart
        assert s.put_many([(k, b"l" * 1000) for k in later]) == (2, 0, 0)
        assert s.contains(failed) == b"\x00\x00" and s.get_many(failed) == [None, None]
        s.flush()  # deletes any index record the failed put left (durability "cache")
        assert all(s._meta.get(k) is None for k in failed)
        assert_counted(s)
        held_items = s.items
    finally:
        s.close()
    again = Store(path, 1 << 30, LRUPolicy(), Counters(), durability=durability)
    try:
        assert again.items == held_items == 5 and again.counters["corrupt_dropped"] == 0
        assert again.contains(held + later) == b"\x01" * 5
    finally:
        again.close()


def test_a_server_answers_a_put_s_memory_error_and_goes_on_storing(tmp_path, monkeypatch):
    from cacheserver.server import CacheServer, ServerConfig

    srv = CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir=str(tmp_path / "d"), capacity=64 << 20))
    srv.start()
    try:
        with ServerClient(srv.address) as c:
            fail_next_record(monkeypatch, MemoryError("out of memory (injected)"))
            with pytest.raises(Exception, match="out of memory \\(injected\\)"):
                c.put([(os.urandom(32), b"a" * 1000)])
            k = os.urandom(32)
            assert c.put([(k, b"b" * 1000)])[0] == 1  # was refused: the store marked failed
            assert bytes(c.get([k])[0]) == b"b" * 1000
            assert srv.store.room.state == "ok" and srv.counters["rejected_disk_full"] == 0
    finally:
        srv.stop(grace=0)


# ---- 3. a replace that a write stop cuts short ----------------------------------------------

def stopped_full_store(path: str, durability: str = "cache") -> tuple[Store, list[bytes]]:
    """A store full with 8 values in 4 level-0 files, and its writes stopped (STOP)."""
    s = Store(path, 8 * SLOT, LRUPolicy(), Counters(), durability=durability)
    s._db.set_options({"disable_auto_compactions": "true"})
    keys = ids(8)
    for i in range(0, 8, 2):
        s.put_many([(k, b"v" * 1000) for k in keys[i:i + 2]])
        s.flush()
    s._db.set_options(STOP)
    assert s._db.property_int_value("rocksdb.is-write-stopped") == 1
    return s, keys


def reopened(path: str, capacity: int, durability: str = "cache") -> Store:
    return Store(path, capacity, LRUPolicy(), Counters(), durability=durability)


def test_a_replace_whose_eviction_a_stop_ends_keeps_the_replaced_record_counted(tmp_path):
    """The replace left its id's index entry, then the eviction for its larger value met the
    stop: the old record stayed on disk, uncounted and unevictable, until a restart served it."""
    path = str(tmp_path / "s")
    s, keys = stopped_full_store(path)
    with pytest.raises(stallwrite.WriteStopped):
        s.put_many([(keys[0], b"n" * 1500)], replace=True)  # must evict one for its 372 more bytes
    assert keys[0] in s._index and bytes(s.get_many(keys[:1])[0]) == b"v" * 1000
    victims = [k for k in keys if k not in s._index]
    assert len(victims) == 1 and s.used == 7 * SLOT  # the victim is deleted once writes go
    s._db.set_options(GO)
    s.flush()
    assert_counted(s)
    s.close()
    again = reopened(path, 8 * SLOT)
    try:
        assert again.items == 7 and again.used == 7 * SLOT and victims[0] not in again._index
        assert again.put_many([(keys[0], b"n" * 1500)], replace=True) == (1, 0, 0)  # and it replaces now
        assert bytes(again.get_many(keys[:1])[0]) == b"n" * 1500
        assert_counted(again)
    finally:
        again.close()


@pytest.mark.parametrize("durability", ["cache", "process"])
def test_a_replace_whose_write_a_stop_ends_keeps_the_replaced_record_counted(tmp_path, durability):
    """The stop refused the replace's first write: nothing of it reached the disk, and the
    replaced record, out of the index, lay there uncounted."""
    path = str(tmp_path / "s")
    s, keys = stopped_full_store(path, durability)
    with pytest.raises(stallwrite.WriteStopped):
        s.put_many([(keys[3], b"n" * 1000)], replace=True)
    assert_counted(s)  # right after the interruption, writes still stopped
    assert s.items == 8 and bytes(s.get_many(keys[3:4])[0]) == b"v" * 1000
    s._db.set_options(GO)
    s.flush()
    assert_counted(s)
    s.close()
    again = reopened(path, 8 * SLOT, durability)
    try:
        assert again.items == 8 and again.used == 8 * SLOT
        assert_counted(again)
    finally:
        again.close()


def test_a_get_that_finds_a_damaged_record_during_a_stop_answers_a_miss(tmp_path):
    """The get deleted the damaged record under the store's lock and raised the stop's
    WriteStopped: reads failed while writes were stopped, though they are meant to go on."""
    path = str(tmp_path / "s")
    s, keys = stopped_full_store(path)
    s._db.set_options(GO)
    s._db.put(keys[2], b"damaged: no trailer")  # as a failing disk would leave it
    s._db.set_options(STOP)
    got = s.get_many(keys[1:4])  # raised WriteStopped here
    assert got[1] is None and [bytes(got[0]), bytes(got[2])] == [b"v" * 1000] * 2
    assert s.counters["corrupt_dropped"] == 1 and keys[2] not in s._index
    s._db.set_options(GO)
    s.flush()  # the delete the stop held back goes in now
    assert s._raw(keys[2]) is None and s._meta.get(keys[2]) is None
    assert_counted(s)
    s.close()
