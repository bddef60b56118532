"""Review of what waits on a write stop that it has no part in (cacheserver/tagtable.py, store.py,
storeflush.py, core.py):

* Store.usage_by_tag took the store's lock, so a Stats call, and a chunk call (UnrefChunk,
  EvictChunk: core._chunk_known), waited while a put held that lock through a write stop: up to
  stallwrite.STUCK_S, or as long as a stop that RocksDB's own work ends lasts.
* OPEN_FOLLOWER (core.open_follower -> Store.flush_for_followers) flushed during a write stop that
  RocksDB's compactions were ending: RocksDB holds the flush until the stop ends, so the server's
  request thread waited out the stop (a compaction's length) to save the follower a replay.

Writes are stopped for real: level 0 past its stop trigger with no compaction due, as in
test_review_write_stop.py, and level 0 at a trigger where a compaction of a few tens of MB is due
and runs (the stop lasts as long as it does). The tests only choose the moment a stop begins."""
import os
import threading
import time

import grpc

from cacheserver import stallwrite
from cacheserver.client.ring_client import RingClient
from cacheserver.client.server_client import ServerClient
from cacheserver.core import CacheCore
from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.server import CacheServer, ServerConfig
from cacheserver.store import OVERHEAD, Store, TagUsage
from test_review_store3_s29 import put_holding_the_lock
from test_review_store_s29 import level0_files, past_the_follower_minimum
from test_review_write_stop import STOP

SMALL = 1000
STOPPED = stallwrite.STOPPED
COMPACTING = "rocksdb.num-running-compactions"


def timed(fn, *args):
    t0 = time.monotonic()
    try:
        answer = fn(*args)
    except grpc.RpcError as e:  # the call's answer, as an error
        answer = e
    return time.monotonic() - t0, answer


def test_stats_and_chunk_calls_answer_while_a_put_holds_the_store_through_a_write_stop(tmp_path, monkeypatch):
    monkeypatch.setattr(stallwrite, "STUCK_S", 4.0)  # a call that waits it out is plain to see
    srv = CacheServer(ServerConfig(listen="127.0.0.1:0", data_dir=str(tmp_path / "d"), capacity=8 << 20))
    srv.start()
    th = None
    try:
        s = srv.store
        s._flusher.stop()  # flushes only where the test makes them
        level0_files(s, 4)  # the least recent entries: the put's eviction takes one of them
        chunk = [(os.urandom(32), os.urandom(SMALL)) for _ in range(2)]
        with RingClient([srv.address]) as ring:
            assert ring.put(chunk, dataset="ds", chunk=0) == 2
        s._db.set_options(STOP)
        assert s._db.property_int_value(STOPPED) == 1
        th, out = put_holding_the_lock(s)
        with ServerClient(srv.address, timeout=30) as c:
            took, stats = timed(c.stats)
            assert took < 1.0, f"Stats waited {took:.1f} s for a put's write stop"
            assert [(x.dataset, x.chunk, x.items, x.bytes) for x in stats.chunks] == [
                ("ds", 0, 2, 2 * (SMALL + OVERHEAD))]
            took, err = timed(c.unref_chunk, "ds", 0, "job")  # core._chunk_known: a chunk held
            assert took < 1.0, f"UnrefChunk waited {took:.1f} s for a put's write stop"
            assert err.code() == grpc.StatusCode.NOT_FOUND and "holds no reference" in err.details(), err
            took, err = timed(c.unref_chunk, "ds", 9, "job")
            assert took < 1.0 and "unknown chunk 9" in err.details(), (took, err)
        assert th.is_alive(), out  # all of it answered during the stop
        th.join(10)
        assert len(out) == 1 and isinstance(out[0], stallwrite.WriteStopped), out
    finally:
        srv.stop(grace=0)
        if th is not None:
            th.join(10)


def test_usage_by_tag_is_whole_while_puts_evictions_and_retags_change_it(tmp_path):
    """Read without the store's lock: each answer is the table at one moment, never a table that
    changed under the copy (RuntimeError: dictionary changed size during iteration)."""
    s = Store(str(tmp_path / "s"), 40 * (SMALL + OVERHEAD), LRUPolicy(), Counters())
    stop, errors, answers = threading.Event(), [], []

    def churn():
        try:
            n = 0
            while not stop.is_set():
                keys = [os.urandom(32) for _ in range(5)]
                s.put_many([(k, os.urandom(SMALL)) for k in keys], ("ds", -1))  # spare
                s.adopt(keys[:2], ("ds", n % 7))  # retags
                s.put_many([(os.urandom(32), os.urandom(SMALL))], (f"t{n % 50}", n % 3))  # evicts, new tags
                n += 1
        except BaseException as e:
            errors.append(e)
    th = threading.Thread(target=churn, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                answers.append(s.usage_by_tag())
            except BaseException as e:
                errors.append(e)
                break
    finally:
        stop.set()
        th.join(10)
    try:
        assert not errors, errors
        assert len(answers) > 100
        for usage in answers:
            assert all(u.items > 0 and u.bytes == u.items * (SMALL + OVERHEAD) for u in usage.values()), usage
        final = s.usage_by_tag()  # nothing changes it now
        assert sum(u.items for u in final.values()) == s.items
        assert sum(u.bytes for u in final.values()) == s.used
        assert all(isinstance(u, TagUsage) for u in final.values())
    finally:
        s.close()


def compaction_stop(s: Store, file_bytes: int = 16 << 20) -> None:
    """4 table files of ``file_bytes`` in level 0, then a stop trigger of 3 with a compaction of
    them due: writes are stopped until that compaction, under way, ends the stop."""
    s._db.set_options({"disable_auto_compactions": "true"})
    for _ in range(4):
        n = file_bytes // 100_000
        assert s.put_many([(os.urandom(32), os.urandom(100_000)) for _ in range(n)]) == (n, 0, 0)
        s.flush()
    past_the_follower_minimum(s)
    s._db.set_options({"level0_file_num_compaction_trigger": "4", "level0_slowdown_writes_trigger": "3",
                       "level0_stop_writes_trigger": "3", "disable_auto_compactions": "false"})


def test_open_follower_does_not_flush_during_a_stop_rocksdb_is_ending(tmp_path):
    # durability "process": no flusher thread, so the memtables hold what was put until asked
    s = Store(str(tmp_path / "s"), 1 << 30, LRUPolicy(), Counters(), durability="process")
    core = CacheCore(s, s.counters)
    try:
        compaction_stop(s)
        db = s._db
        stopped, compacting, stuck = db.property_int_value(STOPPED), db.property_int_value(COMPACTING), \
            s.progress.stuck()
        took, flushed = timed(core.open_follower)
        still = db.property_int_value(STOPPED)
        assert stopped == 1 and compacting >= 1 and stuck is None, (stopped, compacting, stuck)  # RocksDB ends it
        # flushed True after waiting out the compaction on the request thread (the stop over by then)
        assert flushed is False and still == 1, (flushed, still, took)
        assert s.counters["follower_flushes"] == 0  # no back-off begun: the next open may flush
        deadline = time.monotonic() + 60
        while db.property_int_value(STOPPED) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.open_follower() and s.counters["follower_flushes"] == 1  # the stop is over
    finally:
        s.close()
