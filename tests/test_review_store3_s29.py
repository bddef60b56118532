"""Review of the store's flushes and reads under write stops (cacheserver/storeflush.py, storereads.py):

* A flush whose first steps (deleting stranded ids, writing owed server state) waited out a write
  stop and gave up went on into RocksDB's flush, which RocksDB holds for the stop: for ever where
  the stop is one of compactions failing for lack of disk room. A flusher's tick hung, and so did
  close's own last flush (a server's SIGTERM).
* A get that found a corrupt record deleted it under the store's lock, waiting out a write stop
  (up to STUCK_S) inside the read, every other get and put waiting for the lock meanwhile; and it
  waited for the lock itself while a put held it through a stop.
* A close that gave up a flush RocksDB held for such a stop hung in RocksDB's cancel, which
  flushes the values written without the log first, a flush it held for the stop as well; and
  its own last flush skipped for the stop, RocksDB's close flushed and raised the compactions'
  failure, known before, as news.

Writes are stopped for real: compactions that fail for lack of room on a small file system, as in
test_review_space.py (in a process of its own: a flush held for ever fails by its timeout), and
level 0 past its stop trigger with no compaction due, as in test_review_write_stop.py. The tests
only choose the moment a stop begins."""
import os
import textwrap
import threading
import time

import pytest

from cacheserver import stallwrite
from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import OVERHEAD, Store
from test_review_space import COMMON, FULL_DISK, run_script
from test_review_store_s29 import level0_files
from test_review_write_stop import GO, STOP

SMALL = 1000
CAPACITY = 7 * (SMALL + OVERHEAD)  # room for one more than the test puts: a larger put evicts

# The stop that a flush's first step waits out begins inside that step (ballast fills the file
# system while level 0 is at its stop trigger: the compaction fails for lack of room). Before it, a
# stop with no compaction due left what the step writes: stranded ids, or owed server state.
FIRST_STEP_STOPS = COMMON + FULL_DISK + textwrap.dedent("""
    stallwrite.STUCK_S = 1.0
    top, step, caller = sys.argv[1:4]
    s = Store(os.path.join(top, "st"), 40 << 20, LRUPolicy(), Counters())
    s._flusher.stop()  # flushes only where the script makes them
    db = s._db
    db.set_options({"disable_auto_compactions": "true"})
    tag = ("ds", 0)
    for f in range(4):  # 4 table files in level 0: the stop at this capacity, once compactions run
        s.put_many([(os.urandom(32), os.urandom(100_000)) for _ in range(20)], tag if f == 0 else ("", -1))
        s.flush()
    s.put_many([(os.urandom(32), b"u" * 1000)])  # one not flushed yet
    nothing_due = {"level0_file_num_compaction_trigger": "100", "level0_slowdown_writes_trigger": "3",
                   "level0_stop_writes_trigger": "3", "disable_auto_compactions": "false",
                   "max_bytes_for_level_base": str(1 << 40)}  # level 0's size makes no compaction due either
    db.set_options(nothing_due)
    try:
        if step == "_drop_stranded":
            s.evict_tags(lambda t: t == tag)  # its delete stops: the ids are stranded
        else:
            s.keep_state("review", b"state")  # owed
    except stallwrite.WriteStopped:
        pass
    db.set_options({"disable_auto_compactions": "true", "level0_file_num_compaction_trigger": "2",
                    "level0_slowdown_writes_trigger": "4", "level0_stop_writes_trigger": "4",
                    "max_bytes_for_level_base": str(2 << 20)})  # the store's own again (diskbudget.size_lsm)
    note(stranded=len(s._stranded), owed=len(s._state_owed), stopped=db.property_int_value("rocksdb.is-write-stopped"))
    if step == "before_flush":  # after the flush's own checks: RocksDB holds the flush for the stop
        real = s.room.before_flush
    else:
        real = getattr(s, step)

    def stop_begins(*args):
        try:
            fail_a_compaction(db)
        except Exception as e:  # said: else the note below is just missing
            note(stop_error=f"{type(e).__name__}: {e}")
            raise
        note(errors=db.property_int_value("rocksdb.background-errors"),
             stopped_in_step=db.property_int_value("rocksdb.is-write-stopped"))
        real(*args)
    if step == "before_flush":
        s.room.before_flush = stop_begins
    else:
        setattr(s, step, stop_begins)
    flushed = []
    if caller == "flush":  # the flusher's tick, or OPEN_FOLLOWER's flush
        th = threading.Thread(target=lambda: flushed.append(timed(s.flush)), daemon=True)
        th.start()
        th.join(30 if step != "before_flush" else 5)
        note(flush=flushed[0] if flushed else None)
    note(close=in_thread(s.close, 40))
    if caller == "flush":
        th.join(10)
        note(flush_ended=not th.is_alive())
    print(json.dumps(r))
""")


@pytest.mark.parametrize("caller", ["flush", "close"])
@pytest.mark.parametrize("step", ["_drop_stranded", "_pay_state"])
def test_a_flush_whose_first_step_met_a_stop_nothing_ends_does_not_wait_for_it(small_fs, step, caller):
    r = run_script(FIRST_STEP_STOPS, str(small_fs), step, caller, timeout=150)
    assert r["stopped"] == 0 and (r["stranded"] if step == "_drop_stranded" else r["owed"]), r
    assert r.get("errors", 0) >= 1 and r.get("stopped_in_step") == 1, r  # the compaction did fail for lack of room
    if caller == "flush":
        assert r["flush"] is not None and r["flush"][0] < 10 and r["flush"][1] is False, r
        assert r["flush_ended"], r
    # released, the error of the compactions known before logged, not raised (RocksDB's close failed on it)
    assert r["close"] is not None and r["close"][0] < 10 and r["close"][1] is None, r


def test_a_close_ends_a_flush_rocksdb_holds_for_a_stop_nothing_ends(small_fs):
    """The stop began while the flush was under way (a compaction at the stop failed for lack of
    room meanwhile). Close gives that flush up and cancels RocksDB's work: RocksDB's cancel flushed
    the unlogged values first, a flush it held for the stop too, and the close hung there."""
    r = run_script(FIRST_STEP_STOPS, str(small_fs), "before_flush", "flush", timeout=150)
    assert r.get("errors", 0) >= 1 and r.get("stopped_in_step") == 1, r
    assert r["flush"] is None, r  # held by RocksDB: what the close has to end
    assert r["close"] is not None and r["close"][0] < 15 and r["close"][1] is None, r
    assert r["flush_ended"], r


@pytest.fixture
def slow_give_up(monkeypatch):
    monkeypatch.setattr(stallwrite, "STUCK_S", 3.0)  # a read that waits it out is plain to see


def new_store(path: str) -> Store:
    s = Store(path, CAPACITY, LRUPolicy(), Counters())
    s._flusher.stop()  # flushes only where the test makes them
    return s


def damaged(s: Store) -> bytes:
    """A value put, then its record damaged under the store (after the level 0 files: not the
    least recent entry, which a put's eviction takes)."""
    k = os.urandom(32)
    assert s.put_many([(k, os.urandom(SMALL))]) == (1, 0, 0)
    s._db.put(k, b"bad!" * 250 + b"\0" * 8)
    return k


def timed_get(s: Store, keys: list[bytes]) -> tuple[float, list]:
    t0 = time.monotonic()
    got = s.get_many(keys)
    return time.monotonic() - t0, got


def put_holding_the_lock(s: Store) -> tuple[threading.Thread, list]:
    """A put that must evict, waiting out the write stop (in its own write now: its eviction's delete,
    under the store's lock, tries once and leaves the victim for later: test_review_server2_s31.py)."""
    out: list = []
    size = s.capacity - s.used - OVERHEAD + 1  # one byte more than the room left

    def put():
        try:
            out.append(s.put_many([(os.urandom(32), os.urandom(size))]))
        except BaseException as e:
            out.append(e)
    th = threading.Thread(target=put, daemon=True)
    th.start()
    time.sleep(0.5)
    assert th.is_alive(), out
    return th, out


@pytest.mark.parametrize("held", [False, True], ids=["stopped", "lock-held-by-a-stopped-put"])
def test_a_corrupt_record_read_during_a_write_stop_is_a_miss_at_once(tmp_path, slow_give_up, held):
    path = str(tmp_path / "s")
    s = new_store(path)
    level0_files(s, 4)
    good = os.urandom(32)
    assert s.put_many([(good, b"g" * SMALL)]) == (1, 0, 0)
    k = damaged(s)
    s._db.set_options(STOP)
    if held:  # a put that must evict holds the store's lock while its delete waits out the stop
        th, out = put_holding_the_lock(s)
    took, got = timed_get(s, [k, good])
    assert got[0] is None and bytes(got[1]) == b"g" * SMALL
    assert took < 1.0, f"a get waited {took:.1f} s for a write stop"
    if held:
        th.join(10)
        assert len(out) == 1 and isinstance(out[0], stallwrite.WriteStopped), out
        assert timed_get(s, [k])[1] == [None]  # the lock is free: this read drops it
    assert s.counters["corrupt_dropped"] == 1 and k not in s._index and s.contains([k]) == b"\x00"
    took, got = timed_get(s, [k])
    assert got == [None] and took < 1.0
    s._db.set_options(GO)
    s.flush()  # writes go again: the record is deleted
    assert s._raw(k) is None and s._meta.get(k) is None and not s._stranded
    s.close()
    again = Store(path, CAPACITY, LRUPolicy(), Counters())
    try:
        assert again.get_many([k]) == [None] and again.counters["corrupt_dropped"] == 0
        assert bytes(again.get_many([good])[0]) == b"g" * SMALL
    finally:
        again.close()


def test_a_corrupt_record_read_while_writes_go_is_deleted_at_once(tmp_path):
    """Without a stop the delete goes in with the read, not left for a flush."""
    s = new_store(str(tmp_path / "s"))
    try:
        k = damaged(s)
        assert s.get_many([k]) == [None]
        assert s._raw(k) is None and s._meta.get(k) is None and not s._stranded
        assert s.counters["corrupt_dropped"] == 1 and s.items == 0 and s.used == 0
    finally:
        s.close()
