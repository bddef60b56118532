"""Review of the order of the store's writes and its in-memory state (cacheserver/store.py,
storerecovery.py):

* A retag (a spare entry put again under a chunk, or adopted) changed the index before its
  logged write of the new index records: a write stop (or a failure) there left the index on
  the new tag and the disk on the old one until a restart.
* A RocksDB error while rewriting the oldest blob values (relocate_oldest) did not mark the
  store failed; only a later put's write did. A failure there changes nothing else.
* A write stop at start (deleting corrupt index records, evicting for a lowered capacity,
  writing the durable mark) stopped the start: the store now starts, leaving those writes
  until writes go again.

Writes are stopped for real, as test_review_write_stop.py does (its STOP/GO options and
stop_writes); a RocksDB error is a real one, a WAL append past the process's file size limit."""
import os
import resource
import signal

import pytest

from cacheserver import stallwrite
from cacheserver import store as store_module
from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import OVERHEAD, Store
from cacheserver.storerecovery import _META
from test_review_store_failures import assert_counted, ids
from test_review_write_stop import GO, STOP, durable_mark, stop_writes

SPARE, CHUNK = ("ds", -1), ("ds", 2)
LARGE = 300 << 10  # past BLOB_MIN: in blob files


@pytest.fixture(autouse=True)
def quick_give_up(monkeypatch):
    monkeypatch.setattr(stallwrite, "STUCK_S", 0.3)


def tag_on_disk(s: Store, key: bytes) -> tuple[str, int]:
    meta = s._meta.get(key)
    return bytes(meta[_META.size:]).decode(), _META.unpack_from(meta)[2]


def tag_in_index(s: Store, key: bytes) -> tuple[str, int]:
    return s._tags[s._index[key][1]]


# ---- 1. a retag a write stop ends ------------------------------------------------------------

@pytest.mark.parametrize("via", ["put", "adopt"])
def test_a_retag_a_stop_ends_leaves_the_index_and_the_disk_on_the_old_tag(tmp_path, via):
    path = str(tmp_path / "s")
    s = Store(path, 1 << 30, LRUPolicy(), Counters())
    keys = ids(3)
    assert s.put_many([(k, b"s" * 1000) for k in keys], SPARE) == (3, 0, 0)
    stop_writes(s)
    before = s.usage_by_tag()
    if via == "put":  # one try (test_review_server2_s31.py): held still, as spare entries
        assert s.put_many([(k, b"s" * 1000) for k in keys], CHUNK) == (0, 3, 0)
    else:
        assert s.adopt(keys, CHUNK) == b"\x00" * 3
    assert [tag_in_index(s, k) for k in keys] == [SPARE] * 3  # was CHUNK: the disk says SPARE
    assert [tag_on_disk(s, k) for k in keys] == [SPARE] * 3
    assert s.usage_by_tag() == before and s.contains(keys, not_spare=True) == b"\x00" * 3
    assert s.room.state == "ok" and s.counters["put_retagged"] == s.counters["adopted"] == 0
    s._db.set_options(GO)
    assert s.adopt(keys, CHUNK) == b"\x01" * 3  # and it moves once writes go
    assert [tag_on_disk(s, k) for k in keys] == [CHUNK] * 3
    assert_counted(s)
    s.close()
    again = Store(path, 1 << 30, LRUPolicy(), Counters())
    try:
        assert [tag_in_index(again, k) for k in keys] == [CHUNK] * 3
        assert again.usage_by_tag()[CHUNK].items == 3 and SPARE not in again.usage_by_tag()
    finally:
        again.close()


# ---- 2. a failed relocation ------------------------------------------------------------------

def large_store(path: str, durability: str) -> tuple[Store, list[bytes]]:
    s = Store(path, 1 << 30, LRUPolicy(), Counters(), durability=durability)
    keys = ids(3)
    assert s.put_many([(k, os.urandom(LARGE)) for k in keys]) == (3, 0, 0)
    assert list(s._aged) == keys
    return s, keys


def accounting(s: Store) -> tuple:
    return list(s._aged), s.blob_bytes, s.used, s.items, s.counters["relocated_items"], s.counters["relocated_bytes"]


def relocate_past_file_limit(s: Store) -> None:
    """relocate_oldest with every file of this process limited to what the store's log holds now:
    the log's append fails in RocksDB (an I/O error, as on a full disk)."""
    wal = max(os.path.getsize(os.path.join(s.db_path, f)) for f in os.listdir(s.db_path) if f.endswith(".log"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG, the process lives
    resource.setrlimit(resource.RLIMIT_FSIZE, (wal + 4096, hard))
    try:
        s.relocate_oldest(1 << 30)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_rocksdb_error_relocating_fails_the_store_and_changes_nothing_else(tmp_path):
    path = str(tmp_path / "s")
    s, keys = large_store(path, "process")  # relocations go through the log there
    before = accounting(s)
    try:
        with pytest.raises(Exception, match="IO error"):
            relocate_past_file_limit(s)
        assert s.room.state == "failed", "a RocksDB error relocating left the store taking puts"
        assert accounting(s) == before
        assert s.put_many([(os.urandom(32), b"p" * 1000)]) == (0, 0, 1)  # refused, not written
        assert s.contains(keys) == b"\x01" * 3
        assert all(len(v) == LARGE for v in s.get_many(keys))  # reads go on
    finally:
        s.close()  # logs the failed write (RocksDB keeps its lock in this process: no reopen here)


def test_a_stop_relocating_changes_nothing_and_relocating_goes_on_after(tmp_path):
    s, keys = large_store(str(tmp_path / "s"), "cache")
    try:
        stop_writes(s)
        before = accounting(s)
        assert s.relocate_oldest(1 << 30) == 0  # one try (test_review_server2_s31.py): nothing moved
        assert s.room.state == "ok" and accounting(s) == before  # a stop is not the store's failure
        s._db.set_options(GO)
        assert s.relocate_oldest(LARGE) == LARGE + OVERHEAD  # the oldest, moved to the end
        assert list(s._aged) == keys[1:] + keys[:1] and s.counters["relocated_items"] == 1
        assert_counted(s)
    finally:
        s.close()


# ---- 3. a start during a write stop ----------------------------------------------------------

def stopping_at_open(monkeypatch) -> None:
    """Stores opened from here on have their writes stopped right after RocksDB opens, before
    recovery writes anything (STOP, on level 0 as stop_writes leaves it). Opened with STOP's
    compaction trigger, or level 0 is compacted at once; its stop triggers only once open:
    RocksDB raises them to the compaction trigger at open."""
    real_sizes, real_open = store_module.size_lsm, store_module.open_db

    def size_lsm(opts, capacity):
        real_sizes(opts, capacity)
        opts.set_level_zero_file_num_compaction_trigger(int(STOP["level0_file_num_compaction_trigger"]))

    def open_db(*args, **kwargs):
        db, repaired = real_open(*args, **kwargs)
        db.set_options(STOP)
        return db, repaired
    monkeypatch.setattr(store_module, "size_lsm", size_lsm)
    monkeypatch.setattr(store_module, "open_db", open_db)


@pytest.mark.parametrize("durability", ["cache", "process"])
def test_a_store_starts_during_a_write_stop_and_deletes_corrupt_records_later(tmp_path, monkeypatch, durability):
    path = str(tmp_path / "s")
    s = Store(path, 1 << 30, LRUPolicy(), Counters(), durability=durability)
    keys, bad = ids(5), os.urandom(32)
    s.put_many([(k, b"k" * 1000) for k in keys])
    s._meta.put(bad, b"\x01")  # an index record cut short, as a failing disk leaves it
    stop_writes(s)  # 4 table files in level 0
    s._db.set_options(GO)
    s.close()
    stopping_at_open(monkeypatch)
    s = Store(path, 1 << 30, LRUPolicy(), Counters(), durability=durability)  # raised WriteStopped here
    try:
        assert s._db.property_int_value("rocksdb.is-write-stopped") == 1
        assert s.counters["corrupt_dropped"] == 1 and bad not in s._index
        assert all(bytes(v) == b"k" * 1000 for v in s.get_many(keys))  # it serves reads
        assert s.put_many([(os.urandom(32), b"n" * 1000)])[0] == 0  # and refuses puts meanwhile
        s._db.set_options(GO)
        later = ids(3)
        assert s.put_many([(k, b"l" * 1000) for k in later]) == (3, 0, 0)
        s.flush()  # the delete left for later goes in now
        assert s._meta.get(bad) is None and not s._stranded
        if durability == "cache":
            assert durable_mark(s) == s._seq
        held = s.items
        assert_counted(s)
    finally:
        s.close()
    again = Store(path, 1 << 30, LRUPolicy(), Counters(), durability=durability)
    try:
        assert again.items == held and again.counters["corrupt_dropped"] == 0
        assert again.contains(keys + later) == b"\x01" * 8
    finally:
        again.close()


def test_a_store_starts_during_a_write_stop_with_a_lowered_capacity(tmp_path, monkeypatch):
    """Evicting down to the lowered capacity meets the stop: the start goes on, its victims
    leave the index and the disk once writes go again, and puts evict the rest."""
    path = str(tmp_path / "s")
    slot = 1000 + OVERHEAD
    s = Store(path, 1 << 30, LRUPolicy(), Counters())
    keys = ids(8)
    s.put_many([(k, b"k" * 1000) for k in keys])
    stop_writes(s)  # 4 more entries
    s._db.set_options(GO)
    s.close()
    stopping_at_open(monkeypatch)
    s = Store(path, 6 * slot, LRUPolicy(), Counters())  # 12 held: raised WriteStopped here
    try:
        victims = [k for k in keys if k not in s._index]
        assert victims and s.used <= 12 * slot - len(victims) * slot
        s._db.set_options(GO)
        assert s.put_many([(os.urandom(32), b"n" * 1000)]) == (1, 0, 0)
        assert s.used <= s.capacity
        s.flush()
        assert all(s._raw(k) is None and s._meta.get(k) is None for k in victims)
        assert_counted(s)
        held = set(s._index)
    finally:
        s.close()
    again = Store(path, 6 * slot, LRUPolicy(), Counters())
    try:
        assert set(again._index) == held
    finally:
        again.close()
