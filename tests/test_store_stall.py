"""Gets during a put that holds the store's lock, and during a RocksDB write stop
(cacheserver/hitlog.py, cacheserver/stallwrite.py): a hit neither waits for the
lock nor freezes behind a write RocksDB holds back, and still counts for LRU."""
import json
import os
import random
import subprocess
import sys
import textwrap
import threading

import cacheserver
from cacheserver.counters import Counters
from cacheserver.eviction import LRUPolicy
from cacheserver.store import OVERHEAD, Store

CODE = os.path.dirname(os.path.dirname(os.path.abspath(cacheserver.__file__)))  # the tree under test
SLOT = 1000 + OVERHEAD


def ids(n, seed=0):
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def in_thread(fn, timeout):
    """fn() in a thread: (returned in time, its result)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    return bool(out), (out[0] if out else None)


def test_hits_while_the_lock_is_held_do_not_wait_and_still_count_for_lru(tmp_path):
    s = Store(str(tmp_path / "h"), 10 * SLOT, LRUPolicy(), Counters())
    try:
        ks = ids(10, seed=1)
        s.put_many([(k, b"v" * 1000) for k in ks])  # full; LRU order: ks[0] oldest
        with s.lock:  # as a put evicting holds it while RocksDB writes the deletes
            done, values = in_thread(lambda: s.get_many(ks[:1]), 10)
            assert done, "a get waited for the store's lock"
            assert bytes(values[0]) == b"v" * 1000
            done, present = in_thread(lambda: s.touch(ks[1:2]), 10)
            assert done and present == b"\x01", "a get_local waited for the store's lock"
        # both hits count, applied once the lock was free: ks[2] is the least recent now
        assert s.put_many([(ids(1, seed=2)[0], b"n" * 1000)]) == (1, 0, 0)
        assert s.contains(ks[:3]) == b"\x01\x01\x00"
    finally:
        s.close()


def test_hits_queued_behind_a_long_held_lock_stay_bounded(tmp_path):
    s = Store(str(tmp_path / "q"), 10 * SLOT, LRUPolicy(), Counters())
    try:
        ks = ids(10, seed=3)
        s.put_many([(k, b"v" * 1000) for k in ks])
        with s.lock:
            done, _ = in_thread(lambda: [s.get_many(ks[i % 10:i % 10 + 1]) for i in range(500)], 30)
            assert done and len(s._hits._queue) == 500
        s.get_many(ks[9:])  # the lock free again: this get applies the queue
        assert len(s._hits._queue) == 0
    finally:
        s.close()


def test_the_hit_queue_is_bounded_by_ids_not_batches():
    """A same-host follower's touch names up to 100,000 ids in one batch: the bound counts ids."""
    import threading

    from cacheserver.hitlog import MAX_IDS, HitLog

    applied: list[bytes] = []
    lock = threading.Lock()
    log = HitLog(applied.extend, lock)
    batch = 10_000
    with lock:
        for b in range(MAX_IDS // batch + 20):
            log.add([b.to_bytes(4, "big") + i.to_bytes(4, "big") for i in range(batch)])
        queued = sum(len(k) for k in log._queue)
        assert MAX_IDS - batch < queued <= MAX_IDS
    log.add([])  # the lock free: applies the queue, oldest first
    assert len(applied) == queued and not log._queue and log._queued == 0
    last = MAX_IDS // batch + 19
    assert applied[-1] == last.to_bytes(4, "big") + (batch - 1).to_bytes(4, "big")
    assert applied == sorted(applied)


# A store whose writes RocksDB stops (too many L0 files: the option is lowered below
# the files there are, with compactions that would clear them never due), a put that
# must evict (its deletes go to RocksDB under the store's lock), and gets meanwhile.
# In its own process: rocksdict held the GIL through a stopped write, which froze
# every thread of the process, this test's watchdog included.
STALL_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    from cacheserver.counters import Counters
    from cacheserver.eviction import LRUPolicy
    from cacheserver.store import OVERHEAD, Store

    def timed(fn, timeout):
        out, t0 = [], time.monotonic()
        th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
        th.start()
        th.join(timeout)
        return (time.monotonic() - t0 if out else None), (out[0] if out else None)

    s = Store(sys.argv[1], 8 * (1000 + OVERHEAD), LRUPolicy(), Counters())
    db, r = s._db, {}
    db.set_options({"disable_auto_compactions": "true"})
    ks = [os.urandom(32) for _ in range(8)]
    for i in range(0, 8, 2):  # full, and 4 table files in L0
        s.put_many([(k, b"v" * 1000) for k in ks[i:i + 2]])
        s.flush()
    db.set_options({"level0_file_num_compaction_trigger": "100", "level0_slowdown_writes_trigger": "2",
                    "level0_stop_writes_trigger": "3", "disable_auto_compactions": "false"})
    r["stopped"] = db.property_int_value("rocksdb.is-write-stopped")
    put = {}
    putter = threading.Thread(target=lambda: put.update(r=s.put_many([(os.urandom(32), b"n" * 1000)])))
    putter.start()
    deadline, held = time.monotonic() + 20, 0
    while held < 30 and time.monotonic() < deadline:  # the put evicts, and RocksDB holds its write back
        held = held + 1 if putter.is_alive() else 0  # (no longer with the store's lock: test_review_server2_s31)
        time.sleep(0.01)
    r["put_waiting"] = held >= 30
    r["get_s"], values = timed(lambda: s.get_many(ks[6:8]), 5)
    r["get_ok"] = values is not None and [bytes(v) for v in values] == [b"v" * 1000] * 2
    r["touch_s"], present = timed(lambda: s.touch(ks[5:6]), 5)
    r["put_still_waiting"] = putter.is_alive()
    db.set_options({"level0_slowdown_writes_trigger": "100", "level0_stop_writes_trigger": "100"})
    putter.join(20)
    r["put"] = put.get("r")
    r["evicted"] = s.counters["evicted_items"]
    s.close()
    print(json.dumps(r))
""")


def test_gets_go_on_while_rocksdb_stops_a_put_s_writes(tmp_path):
    env = dict(os.environ, PYTHONPATH=CODE)
    try:
        run = subprocess.run([sys.executable, "-c", STALL_SCRIPT, str(tmp_path / "s")], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("the process froze while RocksDB held a put's write back") from None
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["stopped"] == 1 and r["put_waiting"], r  # the stop is real and the put is in it
    assert r["get_s"] is not None and r["get_s"] < 2.0 and r["get_ok"], r  # generous: ms in practice
    assert r["touch_s"] is not None and r["touch_s"] < 2.0, r
    assert r["put_still_waiting"], r  # the gets did not wait for the stop to end
    assert r["put"] == [1, 0, 0] and r["evicted"] == 1, r  # once writes go on, the put completes



def test_stores_stop_writes_but_never_pace_them(tmp_path):
    """A paced write waits inside RocksDB holding the GIL, and a stop that begins during
    it froze the server: the stores' options have stops only (stallwrite.py)."""
    import glob
    import re

    s = Store(str(tmp_path / "o"), 10 * SLOT, LRUPolicy(), Counters())
    s.close()
    text = open(max(glob.glob(str(tmp_path / "o" / "db" / "OPTIONS-*")))).read()
    for family in text.split("[CFOptions ")[1:]:
        opt = dict(re.findall(r"^\s*(\w+)=(.*)$", family, re.M))
        assert opt["level0_slowdown_writes_trigger"] == opt["level0_stop_writes_trigger"]
        assert opt["soft_pending_compaction_bytes_limit"] == opt["hard_pending_compaction_bytes_limit"]
