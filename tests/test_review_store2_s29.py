"""Review of the store's write-stop paths (cacheserver/storeflush.py, store.py):

* An id whose eviction a write stop ended, put again (before the next flush) with a value that
  goes to the other column family (a small one after a large one, or the reverse): the flush
  that deleted what the stop left took the id as put again and deleted nothing, so the old
  copy (a large value in the blob files) stayed on disk for good, counted by no one, until a
  salvage.
* A close while the flusher thread waits out a write stop in the steps before a flush (deleting
  stranded ids, writing owed server state), or while a put waits one out: close released
  RocksDB under that writer (the flusher's thread joined for 10 s only, a put not at all), which
  then wrote to a closed store.

Writes are stopped for real, as test_review_write_stop.py does (level 0 past its stop trigger,
no compaction due); the tests only choose the moment the stop begins."""
import os
import threading
import time

import pytest

from cacheserver import stallwrite
from cacheserver.counters import Counters
from cacheserver.diskbudget import BLOB_MIN
from cacheserver.eviction import LRUPolicy
from cacheserver.flusher import Flusher
from cacheserver.store import OVERHEAD, Store
from test_review_store_s29 import level0_files
from test_review_write_stop import GO, STOP

SMALL = 1000
LONG_STOP_S = 15.0  # a writer waits out a stuck stop this long: past Flusher.stop's old 10 s join


@pytest.fixture(autouse=True)
def quick_give_up(monkeypatch):
    monkeypatch.setattr(stallwrite, "STUCK_S", 0.3)


def new_store(path: str, capacity: int = 1 << 30) -> Store:
    s = Store(path, capacity, LRUPolicy(), Counters())
    s._flusher.stop()  # flushes only where the test makes them, until it starts a flusher again
    return s


def stopped_eviction(s: Store) -> bytes:
    """A put that must evict the least recent entry, its delete ended by a real write stop:
    the victim's id is stranded (left the index, its records on disk)."""
    held = set(s._index)
    s._db.set_options(STOP)
    size = max(1, s.capacity - s.used - OVERHEAD + 1)  # one byte more than the room left
    with pytest.raises(stallwrite.WriteStopped):
        s.put_many([(os.urandom(32), os.urandom(size))])
    victims = held - set(s._index)
    assert len(victims) == 1 and set(s._stranded) >= victims
    return victims.pop()


def every_record_counted(s: Store) -> None:
    """Each value record on disk is an indexed entry's, in the family its charge says."""
    large = {k for k, (charge, _) in s._index.items() if charge >= BLOB_MIN + OVERHEAD}
    assert set(s._large.keys()) == large
    assert set(s._db.keys()) == set(s._index) - large


@pytest.mark.parametrize("gone, back", [(BLOB_MIN, SMALL), (SMALL, BLOB_MIN)], ids=["large-then-small",
                                                                                  "small-then-large"])
@pytest.mark.parametrize("how", ["put", "evict_tags"])
def test_an_id_put_again_after_a_stop_ended_its_eviction_leaves_no_old_copy(tmp_path, gone, back, how):
    path = str(tmp_path / "s")
    capacity = max(gone, back) + OVERHEAD + 4 * (SMALL + OVERHEAD)
    s = new_store(path, capacity)
    key, tag = os.urandom(32), ("ds", 0)
    s._db.set_options({"disable_auto_compactions": "true"})
    assert s.put_many([(key, os.urandom(gone))], tag) == (1, 0, 0)  # the least recent entry
    s.flush()
    level0_files(s, 4)
    if how == "put":
        assert stopped_eviction(s) == key
    else:  # the manager's eviction of its chunk
        s._db.set_options(STOP)
        s.evict_tags(lambda t: t == tag)  # answers at once: the delete is left for a flush
        assert key not in s._index and key in s._stranded
    s._db.set_options(GO)
    value = os.urandom(back)
    assert s.put_many([(key, value)]) == (1, 0, 0)
    s.flush()  # deletes what the stop left
    old = s._large if gone >= BLOB_MIN else s._db
    assert old.get(key) is None, "the evicted copy stayed on disk"
    assert not s._stranded
    s.close()
    again = Store(path, capacity, LRUPolicy(), Counters())
    try:
        assert [bytes(v) for v in again.get_many([key])] == [value]
        every_record_counted(again)
        assert again.used == sum(c for c, _ in again._index.values()) == s.used
    finally:
        again.close()


def flusher_meets_a_stop(s: Store, step: str) -> tuple[threading.Event, list]:
    """Start a flusher whose next flush meets a stop nothing ends in ``step`` (the stop begins
    there for real); returns (set once it did, the errors of the store's logged writes)."""
    entered, errors, writes, real = threading.Event(), [], s._logged, getattr(s, step)

    def logged(build):
        try:
            writes(build)
        except BaseException as e:
            errors.append(e)
            raise
    logged.once = writes.once  # one try, waiting for no stop (_drop_stranded's): nothing to record

    def stopping(*args):
        s._db.set_options(STOP)
        entered.set()
        real(*args)
    s._logged, s.__dict__[step] = logged, stopping
    s._db.set_options(GO)
    s._flusher = Flusher(s._dirty_state, s.flush)
    assert entered.wait(10), "the flusher did not flush"
    time.sleep(0.3)  # inside the write's wait now
    return entered, errors


def timed_close(s: Store) -> float:
    t0 = time.monotonic()
    s.close()
    return time.monotonic() - t0


@pytest.mark.parametrize("step", ["_drop_stranded", "_pay_state"])
def test_close_waits_for_the_flusher_s_writes_before_a_flush(tmp_path, monkeypatch, step):
    path = str(tmp_path / "s")
    s = new_store(path, 6 * (SMALL + OVERHEAD))
    level0_files(s, 4)
    assert s.put_many([(os.urandom(32), os.urandom(SMALL))]) == (1, 0, 0)  # unflushed: the flusher flushes
    if step == "_drop_stranded":
        stopped_eviction(s)
    else:
        s._db.set_options(STOP)
        s.keep_state("review", b"state")  # owed: written before the next flush
        assert s._state_owed
    monkeypatch.setattr(stallwrite, "STUCK_S", LONG_STOP_S)
    _, errors = flusher_meets_a_stop(s, step)
    thread = s._flusher._thread
    took = timed_close(s)
    alive = thread.is_alive()  # close released RocksDB under it
    thread.join(LONG_STOP_S + 5)
    assert not alive and took < 5, f"close took {took:.1f} s and left the flusher writing"
    # each tries once (test_review_server2_s31.py): no write waited out the stop, what it owed kept
    assert not errors and (s._stranded if step == "_drop_stranded" else s._state_owed), errors
    again = Store(path, 6 * (SMALL + OVERHEAD), LRUPolicy(), Counters())
    try:
        every_record_counted(again)
    finally:
        again.close()


def test_close_waits_for_a_put_that_waits_out_a_write_stop(tmp_path, monkeypatch):
    """A server's close after its grace (6 s: less than STUCK_S) while a put waits out a stop."""
    s = new_store(str(tmp_path / "s"))
    level0_files(s, 4)
    s._db.set_options(STOP)
    monkeypatch.setattr(stallwrite, "STUCK_S", LONG_STOP_S)
    out: list = []

    def put():
        try:
            out.append(s.put_many([(os.urandom(32), os.urandom(SMALL))]))
        except BaseException as e:
            out.append(e)
    th = threading.Thread(target=put, daemon=True)
    th.start()
    time.sleep(0.5)
    assert th.is_alive(), out  # waiting out the stop
    took = timed_close(s)
    alive = th.is_alive()
    th.join(LONG_STOP_S + 5)
    assert not alive and took < 5, f"close took {took:.1f} s and left the put writing"
    assert len(out) == 1 and isinstance(out[0], stallwrite.WriteStopped), out  # not a closed store's error

